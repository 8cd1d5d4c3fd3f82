"""A stage's images as the client asked for them: PNG, JPEG or WebP at the requested
compression (OpenAI's `output_format` and `output_compression`), base64 in the result.
The router checks both fields before any stage runs; a family's decode stage calls
`encoded_image` and never picks a format itself."""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

IMAGE_FORMATS = ("png", "jpeg", "webp")
DEFAULT_FORMAT = "png"
# OpenAI's default: the least compression, the most quality.
DEFAULT_COMPRESSION = 100
PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def output_format(params: Mapping[str, object]) -> tuple[str, int]:
    """(format, compression 0-100) from a request's params; the defaults where absent."""
    fmt = str(params.get("output_format") or DEFAULT_FORMAT)
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"output_format must be one of {', '.join(IMAGE_FORMATS)}, got {fmt!r}")
    raw = params.get("output_compression")
    compression = DEFAULT_COMPRESSION if raw is None else int(str(raw))
    if not 0 <= compression <= 100:
        raise ValueError(f"output_compression must be from 0 to 100, got {compression}")
    return fmt, compression


def encoded_bytes(image: Image.Image, fmt: str, compression: int) -> bytes:
    buf = io.BytesIO()
    if fmt == "png":
        image.save(buf, format="PNG")
    elif fmt == "jpeg":
        # JPEG has no alpha channel. At 100, the least lossy JPEG: full-resolution colour
        # (4:4:4), where Pillow's default halves it both ways at every quality.
        subsampling = 0 if compression == 100 else -1
        image.convert("RGB").save(buf, format="JPEG", quality=compression, subsampling=subsampling)
    else:
        # WebP at 100 is lossless, as PNG is: "no compression" loses nothing.
        image.save(buf, format="WEBP", quality=compression, lossless=compression == 100)
    return buf.getvalue()


def encoded_image(image: Image.Image, params: Mapping[str, object]) -> dict[str, str]:
    """The result entry for one image: {"b64_json": ...} in the request's format."""
    fmt, compression = output_format(params)
    return {"b64_json": base64.b64encode(encoded_bytes(image, fmt, compression)).decode()}
