"""Input images for the edit tests: a flat colour with a green diagonal (so an edit's
input is not uniform), and as a request sends one (a PNG in base64); and a served PNG's
pixels as diffusers' output_type="np" gives them, with the PNG's rounding step."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image

# A PNG holds each pixel rounded to 1/255; a pipeline's own float pixels round the same.
PNG_STEP = 1 / 255


def picture(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> Image.Image:
    image = Image.new("RGB", (width, height), colour)
    for x in range(width):
        image.putpixel((x, x % height), (0, 255, 0))
    return image


def png_base64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def pixels(b64: str | None) -> np.ndarray:
    """A served image (base64 PNG) as (H, W, 3) floats in 0-1."""
    image = Image.open(io.BytesIO(base64.b64decode(b64 or "")))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"), dtype=np.float64) / 255


def broken_png(width: int, height: int) -> bytes:
    """An RGBA PNG whose header reads well and whose body does not: its image data split
    in two chunks, the second of a type no PNG has (PIL raises SyntaxError decoding it)."""
    buf = io.BytesIO()
    Image.new("RGBA", (width, height), (0, 0, 0, 255)).save(buf, format="PNG")
    raw, out, pos = buf.getvalue(), buf.getvalue()[:8], 8
    while pos < len(raw):
        (length,) = struct.unpack(">I", raw[pos : pos + 4])
        kind, data = raw[pos + 4 : pos + 8], raw[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind != b"IDAT":
            out += chunk(kind, data)
            continue
        half = len(data) // 2
        out += chunk(b"IDAT", data[:half]) + chunk(b"\x00\x01\x02\x03", data[half:])
    return out


def chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)
