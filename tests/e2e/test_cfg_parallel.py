"""A denoiser with CFG-parallel and int8 weights under `omnipipe serve`: the file's
settings reach the worker, which says so as it loads, and the openai client gets its
image of a request with a negative prompt (the branches split over the two DiT copies)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from PIL import Image

from tests.e2e.conftest import Served, start_serve, stop_cleanly, write_pipeline

ACCELERATION = (
    "  stages:\n    - name: denoise\n      acceleration:\n"
    "        cfgParallelSize: 2\n        quantization: {method: int8-weight-only}\n"
)


@pytest.fixture(scope="module")
def served(tmp_module: Path) -> Iterator[Served]:
    s = start_serve(write_pipeline(tmp_module, "parallel", ACCELERATION))
    yield s
    stop_cleanly(s)


def test_cfg_parallel_and_quantization_serve_an_image(served: Served) -> None:
    said = "".join(served.output)
    assert "the DiT's linear weights are int8-weight-only" in said
    assert "CFG-parallel: negative branches run on cpu, positive ones on cpu" in said
    with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
        r = c.images.generate(
            model="parallel",
            prompt="a lighthouse",
            size="64x64",
            extra_body={
                "num_inference_steps": 4,
                "seed": 1,
                "negative_prompt": "blurry",
                "guidance_scale": 4.0,
            },
        )
    assert r.data[0].b64_json
    image = Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json)))
    assert image.size == (64, 64)
