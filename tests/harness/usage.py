"""The usage an image response should say (OpenAI's shape), counted here from the tiny
checkpoint's own tokenizer and the images' sizes."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import AutoTokenizer

from omnipipe.checkpoints.tiny import resolve_model_path


def expected_usage(
    model: str,
    texts: Sequence[str],
    output_tokens: int,
    image_tokens: int = 0,
    tokenizer: str = "tokenizer",
) -> dict[str, object]:
    """`texts` as `model`'s tokenizer (its folder `tokenizer`) counts them, without
    special tokens; `output_tokens` and `image_tokens` as the DiT's latent patches."""
    loaded = AutoTokenizer.from_pretrained(f"{resolve_model_path(model)}/{tokenizer}")
    text = sum(len(loaded(t, add_special_tokens=False)["input_ids"]) for t in texts)
    return {
        "input_tokens": text + image_tokens,
        "input_tokens_details": {"image_tokens": image_tokens, "text_tokens": text},
        "output_tokens": output_tokens,
        "output_tokens_details": {"image_tokens": output_tokens, "text_tokens": 0},
        "total_tokens": text + image_tokens + output_tokens,
    }
