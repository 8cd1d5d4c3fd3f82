"""Image-edit geometry the router and the workers agree on: the input image is resized
to about a megapixel at its own aspect ratio (as diffusers' QwenImageEditPipeline does)
before the vision-language encoder and the VAE see it (QwenImageEditPlusPipeline gives
its vision-language encoder each of its inputs at about 384x384), and an edit with no
size asks for that size (of its last input, when it has several)."""

from __future__ import annotations

import math

CONDITION_PIXELS = 1024 * 1024
CONDITION_MULTIPLE = 32


def condition_size(width: int, height: int, pixels: int = CONDITION_PIXELS) -> tuple[int, int]:
    """(width, height) of the conditioning image for an input of width x height: about
    `pixels` at its aspect ratio, each side a multiple of 32."""
    ratio = width / height
    side = math.sqrt(pixels * ratio)
    return (
        round(side / CONDITION_MULTIPLE) * CONDITION_MULTIPLE,
        round(side / ratio / CONDITION_MULTIPLE) * CONDITION_MULTIPLE,
    )
