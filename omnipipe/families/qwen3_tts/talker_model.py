"""Qwen3-TTS's talker with its code predictor, on transformers' dense Qwen3 decoder (which
holds both stacks exactly, docs/design/qwen3-tts.md), loaded from the checkpoint's own
weights under their released names.

Each method does what qwen-tts's forward does at that point, with the same operations on
tensors of the same shapes, so that the codes are the reference's for a seed: a GEMM's
rounding on the CPU depends on its shape, so a head applied to one row is not the head
applied to all rows and then sliced."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omnipipe.families.qwen3_tts.config import TTSConfig, qwen3_config

PREFIX = "talker."
# Released weight names under talker. -> this module's.
RENAMES = (
    ("code_predictor.model.codec_embedding.", "code_predictor.embeddings."),
    ("code_predictor.model.", "code_predictor.model."),
    ("code_predictor.lm_head.", "code_predictor.heads."),
    ("code_predictor.small_to_mtp_projection.", "code_predictor.projection."),
    ("model.codec_embedding.", "codec_embedding."),
    ("model.text_embedding.", "text_embedding."),
    ("model.", "model."),
    ("text_projection.", "text_projection."),
    ("codec_head.", "codec_head."),
)


class TextProjection(nn.Module):
    def __init__(self, text_hidden: int, hidden: int, act: str) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)
        self.act_fn = ACT2FN[act]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_fc2(self.act_fn(self.linear_fc1(rows)))
        return out


class CodePredictor(nn.Module):
    """The talker's code predictor: from the talker's last state and a frame's first code,
    the frame's other codes, one group at a time (transformers' dense Qwen3 decoder)."""

    def __init__(self, config: TTSConfig) -> None:
        super().__init__()
        from transformers import Qwen3Model

        t, p = config.talker, config.predictor
        hidden, groups = int(t["hidden_size"]), config.groups
        self.model = Qwen3Model(qwen3_config(p))
        vocab, small = int(p["vocab_size"]), int(p["hidden_size"])
        # Its code tables are at the talker's width: the talker sums them too.
        self.embeddings = nn.ModuleList(nn.Embedding(vocab, hidden) for _ in range(groups - 1))
        self.heads = nn.ModuleList(nn.Linear(small, vocab, bias=False) for _ in range(groups - 1))
        self.projection: nn.Module = (
            nn.Linear(hidden, small, bias=True) if small != hidden else nn.Identity()
        )

    def frames(
        self,
        past_hidden: torch.Tensor,
        first: torch.Tensor,
        picks: Sequence[Callable[[torch.Tensor], int]],
    ) -> tuple[list[list[int]], torch.Tensor]:
        """The frames of several requests as one batch (past_hidden B x 1 x hidden, their
        first codes' embeddings `first` B x 1 x hidden, a pick each): every frame starts
        the predictor afresh at position 0, so the rows line up with no padding. Each
        frame's other codes, each chosen by its pick from its logits, and each frame's
        summed embedding (B x 1 x hidden), the talker's next input before its row."""
        from transformers import DynamicCache

        device = past_hidden.device
        cache = DynamicCache()
        embeds = torch.cat((past_hidden, first), dim=1)
        picked: list[list[int]] = [[] for _ in picks]
        for group in range(len(self.heads)):
            if group > 0:
                embeds = self.embeddings[group - 1](
                    torch.tensor([[p[-1]] for p in picked], device=device)
                )
            start = cache.get_seq_length()
            positions = torch.arange(start, start + embeds.shape[1], device=device)
            out = self.model(
                inputs_embeds=self.projection(embeds),
                position_ids=positions[None].expand(len(picks), -1),
                past_key_values=cache,
                use_cache=True,
            )
            logits = self.heads[group](out.last_hidden_state)[:, -1, :].float()
            for b, (row, pick) in enumerate(zip(picked, picks, strict=True)):
                row.append(pick(logits[b]))
        rows = [first] + [
            self.embeddings[i](torch.tensor([[p[i]] for p in picked], device=device))
            for i in range(len(self.heads))
        ]
        return picked, torch.cat(rows, dim=1).sum(1, keepdim=True)


class TalkerModel(nn.Module):
    def __init__(self, config: TTSConfig) -> None:
        super().__init__()
        from transformers import Qwen3Model

        t = config.talker
        hidden = int(t["hidden_size"])
        self.text_embedding = nn.Embedding(int(t["text_vocab_size"]), int(t["text_hidden_size"]))
        self.text_projection = TextProjection(
            int(t["text_hidden_size"]), hidden, t.get("hidden_act", "silu")
        )
        self.codec_embedding = nn.Embedding(config.vocab, hidden)
        self.model = Qwen3Model(qwen3_config(t))
        self.codec_head = nn.Linear(hidden, config.vocab, bias=False)
        self.code_predictor = CodePredictor(config)

    def load_checkpoint(self, model_path: str) -> None:
        """The talker's weights from the checkpoint, every one accounted for: each of
        ours from it, and none of its talker weights left over."""
        ours: dict[str, torch.Tensor] = {}
        for name, tensor in checkpoint_weights(Path(model_path)):
            if name.startswith(PREFIX):
                ours[renamed(name.removeprefix(PREFIX))] = tensor
        missing, unexpected = self.load_state_dict(ours, strict=False)
        # transformers' stacks keep an input embedding of their own; ours are the codec's.
        missing = [m for m in missing if not m.endswith("embed_tokens.weight")]
        if missing or unexpected:
            raise ValueError(
                f"{model_path}: not a Qwen3-TTS talker this build reads (missing "
                f"{missing[:5]}, unexpected {unexpected[:5]})"
            )

    def text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Text token ids (1 x n) projected into the talker's space (1 x n x hidden)."""
        out: torch.Tensor = self.text_projection(self.text_embedding(ids))
        return out

    def codec_rows(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.codec_embedding(ids)
        return out

    def reference_rows(self, codes: torch.Tensor) -> torch.Tensor:
        """A reference clip's codes (frames x groups) as the talker reads them in an
        in-context prompt (1 x frames x hidden): each frame's codes embedded by their
        group's table and summed, as qwen-tts's generate_icl_prompt sums them."""
        rows = [self.codec_rows(codes[:, :1])] + [
            table(codes[:, i + 1 : i + 2]) for i, table in enumerate(self.code_predictor.embeddings)
        ]
        return torch.cat(rows, dim=1).sum(1).unsqueeze(0)

    def forward_rows(
        self, embeds: torch.Tensor, cache: Any, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds (1 x n x hidden) at positions start.. through the stack: the last row's
        hidden state (1 x 1 x hidden) and its codec logits (float32)."""
        positions = torch.arange(start, start + embeds.shape[1], device=embeds.device)[None]
        out = self.model(
            inputs_embeds=embeds, position_ids=positions, past_key_values=cache, use_cache=True
        )
        hidden: torch.Tensor = out.last_hidden_state
        logits = self.codec_head(hidden)[:, -1, :].float()
        return hidden[:, -1:, :], logits[0]

    def frame(
        self, past_hidden: torch.Tensor, code: int, pick: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        """The frame whose first code is `code`: the predictor's other codes, each chosen by
        `pick` from its logits, and the frame's summed embedding (1 x 1 x hidden), the
        talker's next input before its text row."""
        picked, embeds = self.frames(past_hidden, [code], [pick])
        return picked[0], embeds

    def frames(
        self,
        past_hidden: torch.Tensor,
        codes: Sequence[int],
        picks: Sequence[Callable[[torch.Tensor], int]],
    ) -> tuple[list[list[int]], torch.Tensor]:
        """frame() for several sessions as one batch (past_hidden B x 1 x hidden, a first
        code and a pick each): the code predictor's (CodePredictor.frames)."""
        first = self.codec_rows(torch.tensor([[c] for c in codes], device=past_hidden.device))
        return self.code_predictor.frames(past_hidden, first, picks)


def renamed(name: str) -> str:
    for old, new in RENAMES:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name  # left as it is: load_checkpoint reports it


def checkpoint_weights(root: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, one file (or one shard of its index) at a time."""
    from safetensors.torch import load_file

    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for file in files:
        yield from load_file(str(root / file)).items()
