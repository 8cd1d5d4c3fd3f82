"""What an image stage counts of a request for the response's `usage` (api/wire.py
USAGE_KEYS): the prompt's tokens as the model's tokenizer counts them, and images as the
tokens their DiT attends to (latent patches)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omnipipe.api.wire import IMAGE_TOKENS, OUTPUT_TOKENS, TEXT_TOKENS


def prompt_tokens(tokenizer: Any, texts: Sequence[str], limit: int | None = None) -> dict[str, int]:
    """The texts' tokens (the prompt, and the negative prompt where CFG reads it), without
    the tokenizer's special tokens or the model's template, each at most `limit` (what
    the encoder reads of it, where its limit counts the prompt alone; an encoder whose
    limit counts its template too reads a little less of a prompt near the limit)."""
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return {TEXT_TOKENS: sum(len(row) if limit is None else min(len(row), limit) for row in ids)}


def patches(latents: torch.Tensor, patch: int = 1) -> int:
    """How many tokens a DiT makes of these latents: packed (images, tokens, channels), or
    unpacked (images, channels, [frames,] height, width) in patch x patch squares."""
    if latents.dim() == 3:
        return int(latents.shape[0] * latents.shape[1])
    images, height, width = latents.shape[0], latents.shape[-2], latents.shape[-1]
    return int(images * (height // patch) * (width // patch))


def input_image_tokens(latents: torch.Tensor, patch: int = 1) -> dict[str, int]:
    return {IMAGE_TOKENS: patches(latents, patch)}


def output_image_tokens(latents: torch.Tensor, patch: int = 1) -> dict[str, int]:
    return {OUTPUT_TOKENS: patches(latents, patch)}
