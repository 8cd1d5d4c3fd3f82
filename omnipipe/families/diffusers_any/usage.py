"""What the fallback counts of an image request for the response's `usage`, as the
families count theirs (stagekit/usage.py): the prompt's tokens (and the negative prompt's,
where the call ran CFG) as the pipeline's first tokenizer counts them, and each image as
the tokens its denoiser attends to: the latents the call denoised, in the denoiser's
patches. The latents are read in the step callback, so a pipeline that bins or rounds a
size (Sana's resolution bins) is counted at the size it ran, not the size it returns."""

from __future__ import annotations

import inspect
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


def cfg_ran(pipe: Any, arguments: Mapping[str, Any]) -> bool:
    """Whether a call of `pipe` with `arguments` ran CFG, so read its negative prompt: a
    true-CFG pipeline's (Qwen-Image's, FLUX.1's) with its true_cfg_scale above 1; else the
    pipeline's own do_classifier_free_guidance, set by the call; else a guidance_scale
    above 1. A setting the call left out is the pipeline's default."""
    defaults = {
        name: p.default for name, p in inspect.signature(type(pipe).__call__).parameters.items()
    }
    if "true_cfg_scale" in defaults:
        return _above_one(arguments.get("true_cfg_scale", defaults["true_cfg_scale"]))
    own = getattr(pipe, "do_classifier_free_guidance", None)
    if isinstance(own, bool):
        return own
    return _above_one(arguments.get("guidance_scale", defaults.get("guidance_scale")))


def _above_one(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 1


def text_tokens(pipe: Any, params: Mapping[str, Any], cfg: bool) -> int:
    """The request's prompt, and its negative prompt where the call ran CFG (`cfg`), as
    the pipeline's own tokenizer counts them without its special tokens; 0 for a
    pipeline with none."""
    tokenizer = getattr(pipe, "tokenizer", None)
    if tokenizer is None:
        return 0
    texts = [str(params["prompt"])]
    negative = params.get("negative_prompt")
    if isinstance(negative, str) and negative and cfg:
        texts.append(negative)
    return prompt_tokens(tokenizer, texts)[TEXT_TOKENS]


def image_usage(
    pipe: Any,
    params: Mapping[str, Any],
    cfg: bool,
    images: int,
    per_image: int,
    inputs: int = 0,
) -> dict[str, int]:
    """A request's counts: its text (its negative prompt where the call ran CFG),
    `images` images of `per_image` tokens each, and `inputs` input images at the same
    size (an edit's, resized to its output's)."""
    counted = {TEXT_TOKENS: text_tokens(pipe, params, cfg), OUTPUT_TOKENS: images * per_image}
    if inputs:
        counted[IMAGE_TOKENS] = inputs * per_image
    return counted
