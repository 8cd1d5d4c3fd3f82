"""`omnipipe serve tiny://flux1-dev`: the openai client gets FLUX.1's images, each the one
diffusers' FluxPipeline makes for its seed (within the PNG's rounding), several in one
request; a negative prompt is refused by name in OpenAI's shape."""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from omnipipe.checkpoints.tiny import resolve_model_path
from tests.e2e.conftest import Served, start_serve, stop_cleanly
from tests.harness.pictures import PNG_STEP, pixels
from tests.harness.usage import expected_usage

MODEL = "tiny://flux1-dev"


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    served: Served = start_serve(MODEL)
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            yield c
    finally:
        stop_cleanly(served)


def reference(seed: int, n: int) -> np.ndarray:
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(resolve_model_path(MODEL))
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
    images = np.stack([pixels(d.b64_json) for d in r.data])
    expected = reference(seed=7, n=2)
    assert images.shape == expected.shape == (2, 48, 64, 3)
    np.testing.assert_allclose(images, expected, rtol=0, atol=PNG_STEP / 2 + 1e-4)
    assert np.abs(images[0] - images[1]).max() > 0.05  # each image its own seed
    # T5's tokens of the prompt; two images of (64/16) x (48/16) DiT tokens.
    assert r.usage is not None
    prompt = ["a lighthouse at dusk"]
    assert r.usage.model_dump() == expected_usage(MODEL, prompt, 2 * 12, tokenizer="tokenizer_2")


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
    assert "FLUX.1 takes no negative prompt" in error["message"]


def test_kontext_edits_through_the_openai_client_as_diffusers_does() -> None:
    """`omnipipe serve tiny://flux1-kontext`: images.edit gives FluxKontextPipeline's
    image for the seed, at the size asked; with a mask (OpenAI's: transparent where it
    edits), FluxKontextInpaintPipeline's (white where it repaints), at the input's trained
    size; a second input image is refused by name."""
    from diffusers import FluxKontextPipeline

    source = Image.new("RGB", (96, 64), (200, 30, 30))
    buf = io.BytesIO()
    source.save(buf, format="PNG")
    # A masked edit keeps the input's own latents outside the mask, so its pixels carry
    # the tiny VAE encoder's rounding, which a flat input's near-zero GroupNorm variance
    # blows up with the thread count (0.1 between 1 and 2 threads, seen); noise does not.
    textured = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), np.uint8))
    textured_png = io.BytesIO()
    textured.save(textured_png, format="PNG")
    box = (24, 8, 72, 40)
    mask = Image.new("RGBA", (96, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), box)
    mask_png = io.BytesIO()
    mask.save(mask_png, format="PNG")
    served = start_serve("tiny://flux1-kontext")
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            r = c.images.edit(
                model="tiny://flux1-kontext",
                image=("in.png", buf.getvalue(), "image/png"),
                prompt="make it blue",
                size="64x48",  # type: ignore[arg-type]
                extra_body={"seed": 3, "num_inference_steps": 2, "guidance_scale": 2.5},
            )
            masked = c.images.edit(
                model="tiny://flux1-kontext",
                image=("in.png", textured_png.getvalue(), "image/png"),
                mask=("mask.png", mask_png.getvalue(), "image/png"),
                prompt="a hat on it",
                extra_body={"seed": 4, "num_inference_steps": 2, "guidance_scale": 2.5},
            )
            with pytest.raises(openai.BadRequestError, match="at most 1 input image, got 2"):
                c.images.edit(
                    model="tiny://flux1-kontext",
                    image=[("a.png", buf.getvalue(), "image/png")] * 2,
                    prompt="x",
                )
    finally:
        stop_cleanly(served)
    pipe = FluxKontextPipeline.from_pretrained(resolve_model_path("tiny://flux1-kontext"))
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        image=source,
        prompt="make it blue",
        width=64,
        height=48,
        max_area=64 * 48,  # the size asked is the size made (diffusers scales to this area)
        num_inference_steps=2,
        guidance_scale=2.5,
        generator=[torch.Generator().manual_seed(3)],
        output_type="np",
    ).images
    [item] = r.data or []
    # Past the PNG's rounding, float rounding between the worker's process and this one
    # over the input's 4096 tokens beside the noise's 12 (2.2e-4 at most, seen).
    np.testing.assert_allclose(
        pixels(item.b64_json)[None],
        np.asarray(expected, dtype=np.float64),
        rtol=0,
        atol=PNG_STEP / 2 + 5e-4,
    )
    from diffusers import FluxKontextInpaintPipeline

    inpaint = FluxKontextInpaintPipeline.from_pretrained(resolve_model_path("tiny://flux1-kontext"))
    inpaint.set_progress_bar_config(disable=True)
    repaint = Image.new("L", (96, 64), 0)
    repaint.paste(255, box)
    expected = inpaint(
        image=textured,
        mask_image=repaint,
        prompt="a hat on it",
        num_inference_steps=2,
        guidance_scale=2.5,
        generator=[torch.Generator().manual_seed(4)],
        output_type="np",
    ).images
    [item] = masked.data or []
    assert masked.size == "1248x832"  # the 96x64 input's trained size, as diffusers makes it
    np.testing.assert_allclose(
        pixels(item.b64_json)[None],
        np.asarray(expected, dtype=np.float64),
        rtol=0,
        atol=PNG_STEP / 2 + 5e-4,
    )
