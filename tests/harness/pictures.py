"""Input images for the edit tests: a flat colour with a green diagonal (so an edit's
input is not uniform), and as a request sends one (a PNG in base64)."""

from __future__ import annotations

import base64
import io

from PIL import Image


def picture(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> Image.Image:
    image = Image.new("RGB", (width, height), colour)
    for x in range(width):
        image.putpixel((x, x % height), (0, 255, 0))
    return image


def png_base64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()
