"""The contexts BAGEL generates an image over, as prompts for the think stage's engine:
the conversation itself and its CFG companions, the conversation without its text
(only its images remain; with none, the empty context) and without its images.

Text turns are framed <|im_start|>role\\n ... <|im_end|>\\n, images as
<|vision_start|><|image_pad|><|vision_end|> (vLLM expands the pad into the ViT's tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ASSISTANT = "<|im_start|>assistant\n"
# The tokens around the generation query (the image being made).
IMAGE_START, IMAGE_END = "<|vision_start|>", "<|vision_end|>"
FULL, NO_TEXT, NO_IMAGE = "full", "no_text", "no_image"


@dataclass(frozen=True)
class Turn:
    role: str
    parts: tuple[str | int, ...]  # text, or the index of an image in Prompt.images


@dataclass
class Prompt:
    text: str
    images: list[Any] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.text


def render(turns: list[Turn], images: list[Any], keep_text: bool, keep_images: bool) -> Prompt:
    out, used = [], []
    for turn in turns:
        body = []
        for part in turn.parts:
            if isinstance(part, int):
                if keep_images:
                    body.append(IMAGE)
                    used.append(images[part])
            elif keep_text:
                body.append(part)
        if keep_text:
            out.append(f"<|im_start|>{turn.role}\n{''.join(body)}<|im_end|>\n")
        else:
            out.extend(body)
    return Prompt("".join(out), used)


def image_contexts(
    turns: list[Turn], images: list[Any], text_cfg: bool, image_cfg: bool
) -> dict[str, Prompt]:
    """The full context and the companions the CFG scales ask for. The image companion
    exists only when an image conditions the request (otherwise it is the full context,
    and BAGEL's image CFG would change nothing)."""
    contexts = {FULL: render(turns, images, True, True)}
    if text_cfg:
        contexts[NO_TEXT] = render(turns, images, False, True)
    if image_cfg and images:
        contexts[NO_IMAGE] = render(turns, images, True, False)
    return contexts


def token_id(tokenizer: Any, token: str) -> int:
    return int(str(tokenizer.convert_tokens_to_ids(token)))


def image_markers(tokenizer: Any) -> tuple[int, int]:
    """The ids of the tokens around the generation query."""
    return token_id(tokenizer, IMAGE_START), token_id(tokenizer, IMAGE_END)


def answer_prompt(turns: list[Turn], images: list[Any]) -> Prompt:
    """The prompt the think stage answers in text."""
    prompt = render(turns, images, True, True)
    return Prompt(prompt.text + ASSISTANT, prompt.images)
