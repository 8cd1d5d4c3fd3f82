"""Qwen2.5-Omni's talker on transformers, reproducing the talker part of
Qwen2_5OmniForConditionalGeneration.generate: it starts on the thinker's prompt package
and first reply row and sends codec codes in chunks, one request's forwards at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.families.qwen_omni.checkpoint import load_qwen25_omni
from omnipipe.families.qwen_omni.codec import (
    CodecTalkerSession,
    CodecTalkerStage,
)
from omnipipe.families.qwen_omni.handoff import layout_kwargs
from omnipipe.families.qwen_omni.qwen25 import CHUNK_CODES, TALKER_SAMPLING, samples_per_code
from omnipipe.stagekit.code2wav import SAMPLE_RATE
from omnipipe.stagekit.sampling import Sampling, next_token
from omnipipe.stagekit.stage import (
    Session,
    StageJob,
)


class TalkerStage(CodecTalkerStage):
    def load(self) -> None:
        self.model = load_qwen25_omni(self.model_path, self.device, "talker")
        self.talker = self.model.talker
        self.sampling = Sampling.from_params(TALKER_SAMPLING, self.spec.sampling)
        self.codes_per_second = SAMPLE_RATE / samples_per_code(self.model.config)
        self.chunk_codes = int(self.spec.engine_args.get("chunk_codes", CHUNK_CODES))
        # transformers stops the talker on the codec pad or end token.
        self.stop_codes = frozenset({self.talker.codec_pad_token, self.talker.codec_eos_token})

    def open(self, job: StageJob) -> Session:
        return TalkerSession(self, job.params)


class TalkerSession(CodecTalkerSession):
    def __init__(self, stage: TalkerStage, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        self.stage = stage
        self.tail: torch.Tensor | None = None  # the text-eos then text-pad rows, once drained
        self.seen: list[int] = []
        self.codes: list[int] = []

    @property
    def made(self) -> list[int]:
        return self.codes

    def _next_row(self) -> torch.Tensor | None:
        """The thinker's next reply row; after its end, text-eos once, then text-pad."""
        if self.replies:
            return self.replies.popleft()
        if not self.upstream_done:
            return None
        assert self.prompt is not None
        if self.tail is None:
            self.tail = self.prompt["text_pad_embed"][None]
            return self.prompt["text_eos_embed"][None]
        return self.tail

    def _choose(self, logits: torch.Tensor) -> bool:
        talker = self.stage.talker
        seen = torch.tensor(self.seen + self.codes, dtype=torch.long, device=logits.device)
        suppress: tuple[int, ...] = (talker.codec_bos_token,)
        if len(self.codes) < self.sampling.min_tokens:
            suppress += tuple(self.stage.stop_codes)
        code = next_token(logits, self.sampling, seen, suppress, self.generator)
        if code in self.stage.stop_codes:
            return True
        self.codes.append(code)
        return len(self.codes) >= self.sampling.max_tokens

    def _prefill(self) -> torch.Tensor:
        from transformers import DynamicCache

        assert self.prompt is not None
        talker, p = self.stage.talker, self.prompt
        device = self.stage.device
        input_ids = p["input_ids"][None].to(device)
        first_token_row = self.replies.popleft()
        length = input_ids.shape[1]
        text_ids = torch.cat(
            [input_ids, p["text_bos_id"][None].to(device), p["first_token_id"][None].to(device)],
            dim=1,
        )
        codec_ids = torch.tensor(
            [[talker.codec_mask_token] * length + [talker.codec_pad_token, talker.codec_bos_token]],
            device=device,
        )
        self.seen = codec_ids[0].tolist()
        dtype = talker.thinker_to_talker_proj.weight.dtype
        embeds = torch.cat([p["prompt_embeds"], p["text_bos_embed"][None], first_token_row], dim=0)[
            None
        ].to(device, dtype)
        self.cache = DynamicCache()
        talker.rope_deltas = None
        out = talker(
            input_ids=codec_ids,
            input_text_ids=text_ids,
            inputs_embeds=embeds,
            attention_mask=torch.ones_like(codec_ids),
            **layout_kwargs(p),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.rope_deltas = talker.rope_deltas
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    def _forward(self, row: torch.Tensor) -> torch.Tensor:
        talker = self.stage.talker
        device = self.stage.device
        talker.rope_deltas = self.rope_deltas
        past = self.cache.get_seq_length()
        out = talker(
            input_ids=torch.tensor(
                [[self.codes[-1] if self.codes else self.seen[-1]]], device=device
            ),
            thinker_reply_part=row[None].to(device, talker.thinker_to_talker_proj.weight.dtype),
            attention_mask=torch.ones((1, past + 1), dtype=torch.long, device=device),
            past_key_values=self.cache,
            use_cache=True,
        )
        logits: torch.Tensor = out.logits[0, -1]
        return logits
