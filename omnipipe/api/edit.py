"""Image-edit geometry the router and the workers agree on: the input image is resized
to about a megapixel at its own aspect ratio (as diffusers' QwenImageEditPipeline does)
before the vision-language encoder and the VAE see it, and an edit with no size asks for
that size."""

from __future__ import annotations

import math

CONDITION_PIXELS = 1024 * 1024
CONDITION_MULTIPLE = 32


def condition_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) of the conditioning image for an input of width x height."""
    ratio = width / height
    side = math.sqrt(CONDITION_PIXELS * ratio)
    return (
        round(side / CONDITION_MULTIPLE) * CONDITION_MULTIPLE,
        round(side / ratio / CONDITION_MULTIPLE) * CONDITION_MULTIPLE,
    )
