"""OpenAI's edit `mask` as diffusers' inpainting pipelines take theirs, decoded with the
same guards as the stage kit's images (media.py): the families that inpaint (FLUX.1
Kontext, the diffusers fallback's edits) read it here."""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from omnipipe.stagekit.media import UNDECODABLE
from omnipipe.stagekit.stage import StageInputError


def repaint_mask(mask: Image.Image) -> Image.Image:
    """OpenAI's edit mask as diffusers' inpainting pipelines take theirs.

    OpenAI's `mask` (/v1/images/edits) is a PNG with an alpha channel: its fully
    transparent pixels (alpha 0) are where the image is edited, every other pixel is kept.
    diffusers' `mask_image` is the other way round and in another channel: white pixels
    are repainted, black ones preserved. So alpha 0 becomes white (255) and any other
    alpha, partly transparent included, black (0): a greyscale image of the mask's size."""
    alpha = np.asarray(mask.convert("RGBA"))[..., 3]
    return Image.fromarray(np.where(alpha == 0, np.uint8(255), np.uint8(0)), mode="L")


def decode_mask(data: object, size: tuple[int, int]) -> Image.Image:
    """The request's mask (base64 PNG) as diffusers' mask_image, once its header says it
    is a PNG with alpha of the input image's `size` (the router checked as much: this is
    the stage's own guard, before any pixel is decoded)."""
    try:
        image = Image.open(io.BytesIO(base64.b64decode(str(data), validate=True)))
    except (binascii.Error, UnidentifiedImageError, *UNDECODABLE):
        raise StageInputError("mask: not a decodable PNG", "mask") from None
    with image:
        if image.format != "PNG" or not has_alpha(image):
            raise StageInputError("mask: must be a PNG with an alpha channel", "mask")
        if image.size != size:
            raise StageInputError(
                f"mask: {image.width}x{image.height}, not the image's {size[0]}x{size[1]}",
                "mask",
            )
        try:
            return repaint_mask(image)
        except UNDECODABLE:
            raise StageInputError("mask: not a decodable PNG", "mask") from None


def has_alpha(image: Image.Image) -> bool:
    """An alpha channel, or a PNG's tRNS transparency (which PIL reads as alpha)."""
    return "A" in image.getbands() or "transparency" in image.info
