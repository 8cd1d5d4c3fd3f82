"""The base of the Qwen Omni talkers as vLLM models (qwen25_talker_model.py,
qwen3_talker_model.py; imported only inside a vLLM engine)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.interfaces import SupportsMRoPE


class FedTalker(nn.Module, SupportsMRoPE):
    """What both Qwen Omni talker models share: token ids are codec ids, the positions
    come from the row feed, the logits from the codec head."""

    codec_embedding: nn.Embedding
    codec_head: nn.Linear

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds: torch.Tensor = self.codec_embedding(input_ids)
        return embeds

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list[Any]
    ) -> tuple[torch.Tensor, int]:
        # Placeholders: the feed carries the real positions (the thinker's media layout
        # is not visible here), and replaces these in every forward.
        return torch.arange(len(input_tokens)).expand(3, -1).clone(), 0

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.codec_head(hidden_states)
        return logits
