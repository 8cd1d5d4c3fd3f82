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


@pytest.mark.parametrize("model", ["tiny://sd3", "tiny://sana"])
def test_a_model_with_no_family_is_served_as_its_pipeline_makes_it(model: str) -> None:
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
