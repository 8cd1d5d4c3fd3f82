"""Qwen3-TTS's codec frames on the vLLM talker (stagekit/vllm/frames.py): its code
predictor (talker_model.CodePredictor) for every row that feeds a first code back, each
frame's codes drawn with its request's sampling and generator, as the transformers
talker draws them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from omnipipe.stagekit.sampling import next_token
from omnipipe.stagekit.vllm.frames import FrameFeed, FrameState


def _pick(state: FrameState) -> Callable[[torch.Tensor], int]:
    empty = torch.empty(0, dtype=torch.long)
    return lambda logits: next_token(logits, state.sampling, empty, (), state.generator)


class TalkerFrameFeed(FrameFeed):
    def make_frames(
        self, states: list[FrameState], past: torch.Tensor, codes: torch.Tensor
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        model = self.model
        first = model.codec_embedding(codes)[:, None]
        picked, embeds = model.code_predictor.frames(
            past.to(first.dtype), first, [_pick(s) for s in states]
        )
        return picked, list(embeds[:, 0])
