"""`omnipipe serve tiny://flux2-dev`: the openai client gets FLUX.2 dev's images, each the
one diffusers' Flux2Pipeline makes for its seed (within the PNG's rounding), several in
one request; a negative prompt is refused by name in OpenAI's shape (dev's guidance is
distilled: there is no CFG to take it)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch

from omnipipe.checkpoints.tiny import resolve_model_path
from tests.e2e.conftest import Served, start_serve, stop_cleanly
from tests.harness.pictures import PNG_STEP, pixels

MODEL = "tiny://flux2-dev"


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    served: Served = start_serve(MODEL)
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            yield c
    finally:
        stop_cleanly(served)


def reference(seed: int, n: int) -> np.ndarray:
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(resolve_model_path(MODEL))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt="a lighthouse at dusk",
        width=64,
        height=48,
        num_inference_steps=3,
        guidance_scale=5.0,
        num_images_per_prompt=n,
        generator=[torch.Generator().manual_seed(seed + i) for i in range(n)],
        output_type="np",
    ).images
    return np.asarray(out, dtype=np.float64)


def test_the_served_images_are_diffusers_own_for_the_seed(client: openai.OpenAI) -> None:
    r = client.images.generate(
        model=MODEL,
        prompt="a lighthouse at dusk",
        size="64x48",
        n=2,
        extra_body={"seed": 7, "num_inference_steps": 3, "guidance_scale": 5.0},
    )
    images = np.stack([pixels(d.b64_json) for d in r.data or []])
    expected = reference(seed=7, n=2)
    assert images.shape == expected.shape == (2, 48, 64, 3)
    np.testing.assert_allclose(images, expected, rtol=0, atol=PNG_STEP / 2 + 1e-4)
    assert np.abs(images[0] - images[1]).max() > 0.05  # each image its own seed


def test_a_negative_prompt_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(
            model=MODEL,
            prompt="a cat",
            size="64x64",
            extra_body={"negative_prompt": "blurry", "guidance_scale": 4.0},
        )
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == "negative_prompt"
    assert "FLUX.2 dev takes no negative prompt" in error["message"]
