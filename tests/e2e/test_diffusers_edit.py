"""`omnipipe serve` of tiny://sd3 as `pipeline: diffusers-edit`: the openai client's
images.edit with a mask is StableDiffusion3InpaintPipeline's images (OpenAI's mask as
diffusers takes it) at the size asked; without one, an image at its input's size (the
stage's images equal StableDiffusion3Img2ImgPipeline's: tests/unit/test_diffusers_edit.py);
a bad strength is a 400 naming it, and the image API points to the edit API."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from omnipipe.checkpoints.tiny import resolve_model_path
from tests.e2e.conftest import start_serve, stop_cleanly
from tests.harness.pictures import PNG_STEP, pixels
from tests.harness.usage import expected_usage

pytestmark = pytest.mark.timeout(300)
MANIFEST = """
apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: sd3-edit}
spec: {model: "tiny://sd3", pipeline: diffusers-edit}
"""
FAST = {"num_inference_steps": 4, "guidance_scale": 5.0}
# Past the PNG's rounding, float rounding between the worker's process and this one.
TOLERANCE = PNG_STEP / 2 + 5e-4


def textured(width: int, height: int) -> Image.Image:
    """An input of noise: a flat one's near-zero GroupNorm variance in the tiny VAE's
    encoder blows its rounding up with the thread count (tests/e2e/test_flux.py)."""
    rng = np.random.default_rng(width * height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8))


def inpainted(n: int, seed: int, **call: Any) -> np.ndarray:
    """StableDiffusion3InpaintPipeline's own images, each row called alone with its seed."""
    from diffusers import StableDiffusion3InpaintPipeline

    pipe: Any = StableDiffusion3InpaintPipeline.from_pretrained(resolve_model_path("tiny://sd3"))
    pipe.set_progress_bar_config(disable=True)
    rows = [
        pipe(
            generator=torch.Generator().manual_seed(seed + i), output_type="np", **FAST, **call
        ).images[0]
        for i in range(n)
    ]
    return np.asarray(rows, dtype=np.float64)


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def decoded(b64: str | None) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64 or "")))
    image.load()
    return image


def test_images_edit_with_and_without_a_mask(tmp_path: Path) -> None:
    manifest = tmp_path / "sd3-edit.yaml"
    manifest.write_text(MANIFEST)
    # OpenAI's mask: its transparent left half is edited; diffusers' says so in white.
    mask = Image.new("RGBA", (64, 48), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 32, 48))
    repaint = Image.new("L", (64, 48), 0)
    repaint.paste(255, (0, 0, 32, 48))
    source, other = textured(64, 48), textured(70, 50)
    served = start_serve(manifest)
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
            [listed] = c.models.list().data
            masked = c.images.edit(
                model=listed.id,
                image=("in.png", png(source), "image/png"),
                mask=("mask.png", png(mask), "image/png"),
                prompt="a red door",
                size="32x32",  # type: ignore[arg-type]
                n=2,
                extra_body={**FAST, "seed": 5, "strength": 0.75},
            )
            plain = c.images.edit(
                model=listed.id,
                image=("in.png", png(other), "image/png"),
                prompt="a blue door",
                extra_body={**FAST, "seed": 5},
            )
            with pytest.raises(openai.BadRequestError) as strong:
                c.images.edit(
                    model=listed.id,
                    image=("in.png", png(source), "image/png"),
                    prompt="x",
                    extra_body={"strength": 1.5},
                )
            with pytest.raises(openai.BadRequestError, match="POST /v1/images/edits"):
                c.images.generate(model=listed.id, prompt="x", size="64x64")  # type: ignore[arg-type]
    finally:
        stop_cleanly(served)
    error = strong.value.body
    assert isinstance(error, dict)
    assert error["param"] == "strength"
    made = [decoded(d.b64_json) for d in masked.data or []]
    assert [(i.format, i.size) for i in made] == [("PNG", (32, 32))] * 2
    assert masked.size == "32x32"
    # 32x32 is 4x4 latents, 2x2 of the DiT's 2x2 patches: the input, resized, and 2 images.
    assert masked.usage is not None
    assert masked.usage.model_dump() == expected_usage(
        "tiny://sd3", ["a red door"], 2 * 4, image_tokens=4
    )
    served_images = np.stack([pixels(d.b64_json) for d in masked.data or []])
    own = inpainted(
        2, 5, prompt="a red door", image=source, mask_image=repaint, width=32, height=32,
        strength=0.75,
    )  # fmt: skip
    np.testing.assert_allclose(served_images, own, rtol=0, atol=TOLERANCE)
    assert np.abs(served_images[0] - served_images[1]).max() > 0.01  # each its own seed
    # No size: the 70x50 input's, down to a multiple of 16, and the response says so.
    [item] = plain.data or []
    assert (decoded(item.b64_json).format, decoded(item.b64_json).size) == ("PNG", (64, 48))
    assert plain.size == "64x48"
