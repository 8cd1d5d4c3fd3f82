"""`omnipipe serve tiny://z-image`: the openai client gets Z-Image's images, each the one
diffusers' ZImagePipeline makes for its seed (within the PNG's rounding), with CFG and a
negative prompt, several in one request, and without CFG (guidance 0, as Turbo runs);
the options Z-Image takes only under CFG are refused by name in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
import torch

from omnipipe.checkpoints.tiny import resolve_model_path
from tests.e2e.conftest import Served, start_serve, stop_cleanly
from tests.harness.pictures import PNG_STEP, pixels
from tests.harness.usage import expected_usage

MODEL = "tiny://z-image"


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    served: Served = start_serve(MODEL)
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            yield c
    finally:
        stop_cleanly(served)


def reference(seed: int, n: int, **options: Any) -> np.ndarray:
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(resolve_model_path(MODEL))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt="a lighthouse at dusk",
        width=64,
        height=48,
        num_inference_steps=3,
        num_images_per_prompt=n,
        generator=[torch.Generator().manual_seed(seed + i) for i in range(n)],
        output_type="np",
        **options,
    ).images
    return np.asarray(out, dtype=np.float64)


@pytest.mark.parametrize(
    "options",
    [{"guidance_scale": 4.0, "negative_prompt": "blurry, low quality"}, {"guidance_scale": 0.0}],
    ids=["cfg", "no-cfg"],
)
def test_the_served_images_are_diffusers_own_for_the_seed(
    client: openai.OpenAI, options: dict[str, Any]
) -> None:
    r = client.images.generate(
        model=MODEL,
        prompt="a lighthouse at dusk",
        size="64x48",
        n=2,
        extra_body={"seed": 7, "num_inference_steps": 3, **options},
    )
    images = np.stack([pixels(d.b64_json) for d in r.data or []])
    expected = reference(seed=7, n=2, **options)
    assert images.shape == expected.shape == (2, 48, 64, 3)
    np.testing.assert_allclose(images, expected, rtol=0, atol=PNG_STEP / 2 + 1e-4)
    assert np.abs(images[0] - images[1]).max() > 0.05  # each image its own seed
    # The negative prompt's tokens count where CFG reads it; two images of 12 DiT tokens.
    texts = [
        "a lighthouse at dusk",
        *([options["negative_prompt"]] if "negative_prompt" in options else []),
    ]
    assert r.usage is not None
    assert r.usage.model_dump() == expected_usage(MODEL, texts, 2 * 12)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"guidance_scale": 0.0, "cfg_truncation": 0.5}, "cfg_truncation", "only under CFG"),
        ({"cfg_normalization": "yes"}, "cfg_normalization", "must be a number"),
        # The image API refuses a negative prompt where there is no CFG: Z-Image's runs above 0.
        ({"guidance_scale": 0.0, "negative_prompt": "fog"}, "guidance_scale", "negative_prompt"),
    ],
)
def test_an_option_z_image_cannot_take_is_a_400_naming_it(
    client: openai.OpenAI, extra: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model=MODEL, prompt="a cat", size="64x64", extra_body=extra)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == param
    assert words in error["message"]
