"""Load one part of a Qwen2.5-Omni checkpoint through transformers' from_pretrained."""

from __future__ import annotations

from typing import Any

import torch

PARTS = ("thinker", "talker", "token2wav")


def load_qwen25_omni(path: str, device: torch.device, part: str) -> Any:
    """The whole model object with only `part` kept (and the speaker map), on device.

    The released checkpoint is one file set for all three parts; loading it whole and
    dropping the rest keeps the normal from_pretrained path (and its key mapping)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=dtype)
    for other in PARTS:
        if other != part and hasattr(model, other):
            delattr(model, other)
    if part == "token2wav":
        model.token2wav.float()  # transformers runs token2wav in float32 only
    return model.to(device).eval()
