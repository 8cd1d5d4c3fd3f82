"""`omnipipe serve tiny://flux2-dev`: the openai client gets FLUX.2 dev's images, each the
one diffusers' Flux2Pipeline makes for its seed (within the PNG's rounding), several in
one request; a negative prompt is refused by name in OpenAI's shape (dev's guidance is
distilled: there is no CFG to take it). The same checkpoint served as flux2-edit edits
with two reference images as Flux2Pipeline(image=[...]) does."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from omnipipe.checkpoints.tiny import resolve_model_path
from tests.e2e.conftest import Served, start_serve, stop_cleanly
from tests.harness.pictures import PNG_STEP, picture, pixels, png_base64
from tests.harness.usage import expected_usage

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


EDIT_MANIFEST = """
apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: flux2-edit}
spec: {model: "tiny://flux2-dev", pipeline: flux2-edit}
"""


def test_a_flux2_edit_with_two_references_is_diffusers_own(tmp_path: Path) -> None:
    """tiny://flux2-dev served as flux2-edit (the same checkpoint): images.edit with two
    images gives Flux2Pipeline(image=[both])'s image for the seed; eleven are a 400
    naming dev's ten, and the image API refuses the edit type."""
    from diffusers import Flux2Pipeline

    manifest = tmp_path / "flux2-edit.yaml"
    manifest.write_text(EDIT_MANIFEST)
    first, second = picture(96, 64), picture(64, 80, (30, 30, 200))
    sent = [
        (f"{i}.png", base64.b64decode(png_base64(p)), "image/png")
        for i, p in enumerate((first, second))
    ]
    served = start_serve(manifest)
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            r = c.images.edit(
                model="flux2-edit",
                image=sent,
                prompt="the cat of image 1 on the sofa of image 2",
                size="64x48",  # type: ignore[arg-type]
                extra_body={"seed": 7, "num_inference_steps": 3, "guidance_scale": 5.0},
            )
            with pytest.raises(openai.BadRequestError, match="at most 10 input images, got 11"):
                c.images.edit(model="flux2-edit", image=[sent[0]] * 11, prompt="x")
            with pytest.raises(openai.BadRequestError, match="/v1/images/edits"):
                c.images.generate(model="flux2-edit", prompt="x", size="64x64")
    finally:
        stop_cleanly(served)
    [item] = r.data or []
    pipe = Flux2Pipeline.from_pretrained(resolve_model_path(MODEL))
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        image=[first, second],
        prompt="the cat of image 1 on the sofa of image 2",
        width=64,
        height=48,
        num_inference_steps=3,
        guidance_scale=5.0,
        generator=[torch.Generator().manual_seed(7)],
        output_type="np",
    ).images
    got = pixels(item.b64_json)
    assert got.shape == (48, 64, 3)
    # In: the prompt's tokens and the references' DiT tokens, (96/16)(64/16) + (64/16)(80/16)
    # (each side already a multiple of 16: diffusers keeps them). Out: (64/16)(48/16).
    assert r.usage is not None
    prompt = ["the cat of image 1 on the sofa of image 2"]
    assert r.usage.model_dump() == expected_usage(MODEL, prompt, 12, image_tokens=24 + 20)
    np.testing.assert_allclose(got, np.asarray(expected[0]), rtol=0, atol=PNG_STEP / 2 + 1e-4)
