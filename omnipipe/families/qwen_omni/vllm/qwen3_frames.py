"""Qwen3-Omni's codec frames on the vLLM talker (stagekit/vllm/frames.py): its code
predictor, transformers' Qwen3-Omni one, run for every row that feeds a first code back."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.stagekit.sampling import next_token
from omnipipe.stagekit.vllm.frames import FrameFeed, FrameState

__all__ = ["FrameState", "Qwen3FrameFeed"]


class Qwen3FrameFeed(FrameFeed):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.groups = groups

    def make_frames(
        self, states: list[FrameState], past: torch.Tensor, codes: torch.Tensor
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        from transformers import DynamicCache

        model = self.model
        first = model.codec_embedding(codes)
        totals = [row.clone() for row in first]
        predictor = model.code_predictor
        cache = DynamicCache()
        picks: list[list[int]] = [[] for _ in states]
        for group in range(self.groups - 1):
            if group == 0:
                inputs: dict[str, Any] = {"inputs_embeds": torch.cat([past, first[:, None]], 1)}
            else:  # the predictor embeds the previous residual code itself
                inputs = {"input_ids": torch.tensor([[p[-1]] for p in picks], device=codes.device)}
            out = predictor(**inputs, past_key_values=cache, use_cache=True, generation_steps=group)
            logits = out.logits[:, -1]
            empty = torch.empty(0, dtype=torch.long)
            for i, state in enumerate(states):
                picks[i].append(
                    next_token(logits[i], state.sampling, empty, generator=state.generator)
                )
            embedding = predictor.get_input_embeddings()[group]
            added = embedding(torch.tensor([p[-1] for p in picks], device=codes.device))
            totals = [total + row for total, row in zip(totals, added, strict=True)]
        return picks, totals
