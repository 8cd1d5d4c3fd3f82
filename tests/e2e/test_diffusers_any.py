"""`omnipipe serve tiny://sd3` and `omnipipe serve tiny://sana`: two checkpoints that no
family claims are served whole by the diffusers fallback, and the openai client gets the
images each pipeline makes for the seed (within the PNG's rounding); an edit is refused
in OpenAI's shape."""

from __future__ import annotations

from typing import Any

import numpy as np
import openai
import pytest
import torch

from omnipipe.checkpoints.tiny import resolve_model_path
from tests.e2e.conftest import start_serve, stop_cleanly
from tests.harness.pictures import PNG_STEP, pixels
from tests.harness.usage import expected_usage


def reference(model: str, n: int, seed: int, **call: Any) -> np.ndarray:
    from diffusers import DiffusionPipeline

    pipe: Any = DiffusionPipeline.from_pretrained(resolve_model_path(model))
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        prompt="a lighthouse at dusk",
        num_images_per_prompt=n,
        generator=[torch.Generator().manual_seed(seed + i) for i in range(n)],
        output_type="np",
        **call,
    ).images
    return np.asarray(images, dtype=np.float64)


# Each image's tokens in the usage, as its DiT attends to them at 64x48: SD3's 8x6
# latents in 2x2 patches; Sana's pipeline bins the size to 576x416, 18x13 latents of its
# 32x down DC-AE, one token each.
@pytest.mark.parametrize(("model", "tokens"), [("tiny://sd3", 12), ("tiny://sana", 18 * 13)])
def test_a_model_with_no_family_is_served_as_its_pipeline_makes_it(model: str, tokens: int) -> None:
    served = start_serve(model)
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            [listed] = c.models.list().data
            r = c.images.generate(
                model=listed.id,
                prompt="a lighthouse at dusk",
                size="64x48",
                n=2,
                extra_body={
                    "seed": 5,
                    "num_inference_steps": 3,
                    "guidance_scale": 5.0,
                    "negative_prompt": "blurry",
                },
            )
            with pytest.raises(openai.BadRequestError) as refused:
                c.images.edit(
                    model=listed.id,
                    image=("in.png", b"\x89PNG\r\n\x1a\n", "image/png"),
                    prompt="make it blue",
                )
    finally:
        stop_cleanly(served)
    assert "edit" in str(refused.value.body)
    assert r.usage is not None
    assert r.usage.model_dump() == expected_usage(
        model, ["a lighthouse at dusk", "blurry"], 2 * tokens
    )
    images = np.stack([pixels(d.b64_json) for d in r.data or []])
    expected = reference(
        model,
        n=2,
        seed=5,
        width=64,
        height=48,
        num_inference_steps=3,
        guidance_scale=5.0,
        negative_prompt="blurry",
    )
    assert images.shape == expected.shape == (2, 48, 64, 3)
    np.testing.assert_allclose(images, expected, rtol=0, atol=PNG_STEP / 2 + 1e-4)
    assert np.abs(images[0] - images[1]).max() > 0.05  # each image its own seed
