"""What the fallback counts of an image request for the response's `usage`, as the
families count theirs (stagekit/usage.py): the prompt's tokens (and the negative prompt's,
where the call ran CFG) as the pipeline's first tokenizer counts them, and each image as
the tokens its denoiser attends to: the latents the call denoised, in the denoiser's
patches. The latents are read in the step callback, so a pipeline that bins or rounds a
size (Sana's resolution bins) is counted at the size it ran, not the size it returns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omnipipe.api.wire import IMAGE_TOKENS, OUTPUT_TOKENS, TEXT_TOKENS
from omnipipe.stagekit.usage import patches, prompt_tokens


def denoiser_patch(pipe: Any) -> int:
    """The side of the square a DiT takes as one token (SD3's 2); 1 for a UNet, or a
    denoiser that patches nothing."""
    denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    patch = getattr(getattr(denoiser, "config", None), "patch_size", None)
    return patch if isinstance(patch, int) and patch >= 1 else 1


def row_patches(pipe: Any, latents: Any) -> int:
    """One row's tokens of a call's latents: (rows, tokens, channels) when packed, else
    (rows, channels, height, width); 0 for a tensor of neither shape."""
    if not isinstance(latents, torch.Tensor) or latents.dim() not in (3, 4) or not len(latents):
        return 0
    return patches(latents[:1], denoiser_patch(pipe))


def text_tokens(pipe: Any, params: Mapping[str, Any]) -> int:
    """The request's prompt, and its negative prompt where the call ran CFG (most
    pipelines' do_classifier_free_guidance, set by the call), as the pipeline's own
    tokenizer counts them without its special tokens; 0 for a pipeline with none."""
    tokenizer = getattr(pipe, "tokenizer", None)
    if tokenizer is None:
        return 0
    texts = [str(params["prompt"])]
    negative = params.get("negative_prompt")
    if (
        isinstance(negative, str)
        and negative
        and getattr(pipe, "do_classifier_free_guidance", True)
    ):
        texts.append(negative)
    return prompt_tokens(tokenizer, texts)[TEXT_TOKENS]


def image_usage(
    pipe: Any, params: Mapping[str, Any], images: int, per_image: int, inputs: int = 0
) -> dict[str, int]:
    """A request's counts: its text, `images` images of `per_image` tokens each, and
    `inputs` input images at the same size (an edit's, resized to its output's)."""
    counted = {TEXT_TOKENS: text_tokens(pipe, params), OUTPUT_TOKENS: images * per_image}
    if inputs:
        counted[IMAGE_TOKENS] = inputs * per_image
    return counted
