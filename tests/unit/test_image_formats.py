"""Images in the format the client asks for (OpenAI's output_format, output_compression
and background): the stage kit encodes them, the router refuses what no stage could do,
by name, before any stage runs."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from omnipipe.stagekit.image_output import encoded_image, output_format
from tests.unit.test_router_edges import app_for, openai_error


def picture() -> Image.Image:
    """Noise: a format that compresses shows it in its size."""
    rng = np.random.default_rng(7)
    return Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8))


def decoded(entry: dict[str, str]) -> Image.Image:
    assert set(entry) == {"b64_json"}
    image = Image.open(io.BytesIO(base64.b64decode(entry["b64_json"])))
    image.load()
    return image


@pytest.mark.parametrize(("fmt", "pil"), [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_each_format_is_what_it_says_at_the_size_drawn(fmt: str, pil: str) -> None:
    image = decoded(encoded_image(picture(), {"output_format": fmt}))
    assert image.format == pil
    assert image.size == (96, 64)


def test_png_and_webp_at_100_lose_nothing_and_compression_shrinks_jpeg_and_webp() -> None:
    original = np.asarray(picture())
    for params in ({}, {"output_format": "png"}, {"output_format": "webp"}):
        assert np.array_equal(np.asarray(decoded(encoded_image(picture(), params))), original)
    for fmt in ("jpeg", "webp"):
        sizes = [
            len(
                encoded_image(picture(), {"output_format": fmt, "output_compression": c})[
                    "b64_json"
                ]
            )
            for c in (100, 50, 10)
        ]
        assert sizes[0] > sizes[1] > sizes[2], (fmt, sizes)
    lossy = np.asarray(decoded(encoded_image(picture(), {"output_format": "jpeg"})), dtype=int)
    # At 100 (the default), JPEG loses little even of noise: colour at full resolution.
    assert 0 < np.abs(lossy - original).mean() < 4


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"output_format": "gif"}, "output_format must be one of png, jpeg, webp"),
        ({"output_format": "jpeg", "output_compression": 101}, "from 0 to 100"),
    ],
)
def test_a_stage_given_a_format_it_cannot_write_says_which(
    params: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        output_format(params)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"output_format": "gif"}, "output_format", "png"),
        ({"output_compression": 80}, "output_compression", "jpeg and webp"),
        ({"output_format": "jpeg", "output_compression": 101}, "output_compression", "100"),
        ({"background": "transparent"}, "background", "opaque"),
        ({"n": 11}, "n", "10"),
    ],
)
def test_what_no_stage_can_do_is_a_400_naming_the_field(
    tmp_path: Path, fields: dict[str, Any], param: str, says: str
) -> None:
    # No replica is ready: a request that got past the checks would be a 503.
    with TestClient(app_for(tmp_path), raise_server_exceptions=False) as client:
        resp = client.post(
            "/v1/images/generations", json={"model": "tiny-image", "prompt": "x", **fields}
        )
    error = openai_error(resp, 400)
    assert error["param"] == param, error
    assert says in error["message"], error


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 10, "output_format": "jpeg", "output_compression": 0},
        {"output_format": "webp", "background": "opaque"},
        {"background": "auto"},
    ],
)
def test_what_a_stage_can_do_passes_the_checks(tmp_path: Path, fields: dict[str, Any]) -> None:
    with TestClient(app_for(tmp_path), raise_server_exceptions=False) as client:
        resp = client.post(
            "/v1/images/generations", json={"model": "tiny-image", "prompt": "x", **fields}
        )
    assert resp.status_code == 503, resp.text  # past the checks, to the (absent) stages
