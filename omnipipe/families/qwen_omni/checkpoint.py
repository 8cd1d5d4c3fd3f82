"""Load one part of a Qwen Omni checkpoint through transformers' from_pretrained."""

from __future__ import annotations

from typing import Any

import torch

QWEN25_OMNI = "qwen2_5_omni"
QWEN3_OMNI = "qwen3_omni_moe"
PARTS = {
    QWEN25_OMNI: ("thinker", "talker", "token2wav"),
    QWEN3_OMNI: ("thinker", "talker", "code2wav"),
}


def omni_model_type(path: str) -> str:
    """The checkpoint's model_type, which decides the stage classes that run it."""
    from transformers import AutoConfig

    model_type = str(AutoConfig.from_pretrained(path).model_type)
    if model_type not in PARTS:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not an omni model this worker runs; "
            f"supported: {', '.join(PARTS)}"
        )
    return model_type


def _load_part(
    model_class: Any, parts: tuple[str, ...], path: str, device: torch.device, part: str
) -> Any:
    """The whole model object with only `part` kept (and, for Qwen2.5, the speaker map).

    The released checkpoint is one file set for all parts; loading it whole and dropping
    the rest keeps the normal from_pretrained path (and its key mapping)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = model_class.from_pretrained(path, dtype=dtype)
    for other in parts:
        if other != part and hasattr(model, other):
            delattr(model, other)
    return model


def load_qwen25_omni(path: str, device: torch.device, part: str) -> Any:
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = _load_part(Qwen2_5OmniForConditionalGeneration, PARTS[QWEN25_OMNI], path, device, part)
    if part == "token2wav":
        model.token2wav.float()  # transformers runs token2wav in float32 only
    return model.to(device).eval()


def load_qwen3_omni(path: str, device: torch.device, part: str) -> Any:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = _load_part(Qwen3OmniMoeForConditionalGeneration, PARTS[QWEN3_OMNI], path, device, part)
    return model.to(device).eval()
