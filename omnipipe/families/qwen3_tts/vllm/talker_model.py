"""Qwen3-TTS's talker as a vLLM model (imported only inside a vLLM engine).

vLLM's dense Qwen3 decoder (its config written from the talker's, vocab the codec's) with
the checkpoint's own input and output: each position's input is the stage's row for it
(the prompt's rows, then the text's, then tts_pad, stagekit/vllm/feed.py) plus, from the
prompt's end on, the summed embedding of the frame whose first code is fed back there;
the code predictor (talker_model.CodePredictor) makes that frame inside the forward, for
every such row of the batch at once (frames.py). The positions are plain: the talker's
M-RoPE has three equal rows for text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3 import Qwen3Model
from vllm.model_executor.models.utils import PPMissingLayer, maybe_prefix

from omnipipe.families.qwen3_tts.config import read_config
from omnipipe.families.qwen3_tts.talker_model import PREFIX, CodePredictor, renamed
from omnipipe.stagekit.vllm.feed import StepFeed
from omnipipe.stagekit.vllm.frames import FrameFeed, fed_inputs

# The checkpoint's folder, in the vLLM config the stage writes: the code predictor's
# shape is read from its config.json.
CHECKPOINT_KEY = "omnipipe_checkpoint"


class TalkerForVllm(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        tts = read_config(getattr(config, CHECKPOINT_KEY))
        hidden = int(config.hidden_size)
        self.model = Qwen3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        # The codec embedding below is the input; Qwen3Model's own has no weights.
        self.model.embed_tokens = PPMissingLayer()  # type: ignore[no-untyped-call,assignment]
        self.codec_embedding = nn.Embedding(tts.vocab, hidden)
        self.codec_head = nn.Linear(hidden, tts.vocab, bias=False)
        self.code_predictor = CodePredictor(tts)
        # transformers' stack keeps a token table of its own, which the predictor never
        # reads (it is given embeddings) and the checkpoint does not hold.
        self.code_predictor.model.embed_tokens = nn.Identity()  # type: ignore[assignment]
        self.feed: StepFeed | None = None
        self.frames: FrameFeed | None = None  # set by the feed when its hook is installed

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds: torch.Tensor = self.codec_embedding(input_ids)
        return embeds

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.codec_head(hidden_states)
        return logits

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        assert input_ids is not None, "the talker takes codec ids, not embeddings"
        codec = self.codec_embedding(input_ids)
        summed, fed = fed_inputs(self.feed, self.frames, codec, input_ids)
        if fed is not None:
            positions = fed[0]  # three equal rows: plain positions
        hidden: torch.Tensor = self.model(None, positions, None, inputs_embeds=summed)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's talker.* tensors, under transformers' names (talker_model's
        renames); the text tables and the speaker encoder are the stage's."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        decoder: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if not name.startswith(PREFIX):
                continue
            ours = renamed(name.removeprefix(PREFIX))
            if ours.startswith(("text_embedding.", "text_projection.")):
                continue  # the stage makes the rows
            if ours.startswith("model."):
                decoder.append((ours.removeprefix("model."), tensor))
                continue
            with torch.no_grad():
                params[ours].copy_(tensor)
            loaded.add(ours)
        loaded |= {f"model.{n}" for n in self.model.load_weights(decoder)}
        return loaded
