"""An offline Qwen2 byte-level tokenizer: the 256 byte characters plus Qwen's special
tokens, with no merges. Real Qwen code paths run on it without a model hub."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken
from transformers import Qwen2Tokenizer

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|AUDIO|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
)


def _byte_chars() -> list[str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def save_byte_tokenizer(
    directory: Path,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    named_tokens: dict[str, str] | None = None,
    max_length: int | None = None,
) -> Qwen2Tokenizer:
    """special_tokens[0] is the pad/unk token; named_tokens become attributes such as
    tokenizer.image_token, which multimodal processors read; max_length, the length a
    pipeline pads to where it reads the tokenizer's (CLIP's 77, T5's sequence)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Qwen2Tokenizer(
        vocab={ch: i for i, ch in enumerate(_byte_chars())},
        merges=[],
        unk_token=special_tokens[0],
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token=special_tokens[0],
        extra_special_tokens=named_tokens or {},
    )
    # transformers 5 ignores an `additional_special_tokens` argument: add them explicitly,
    # or each becomes the unknown token and the chat template is split into bytes.
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens[1:]],
        special_tokens=True,
    )
    if max_length is not None:
        tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(directory))
    return tokenizer
