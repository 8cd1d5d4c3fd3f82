"""A masked tiny://flux1-kontext edit through the four stages equals diffusers'
FluxKontextInpaintPipeline (image= and mask_image=, strength 1.0, no image_reference)
for the same seed, denoised in one batch beside an unmasked edit that equals
FluxKontextPipeline's; OpenAI's mask (alpha 0: edit) becomes diffusers' (white: repaint)
exactly as diffusers' own mask processing reads the white one; the router's size of a
masked edit is the one diffusers makes; and a bad mask is refused naming `mask`."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.flux.inpaint import latent_mask, pack_mask
from omnipipe.families.flux.requests import EXTENSIONS, KONTEXT_RESOLUTIONS, kontext_size
from omnipipe.stagekit.masks import decode_mask
from omnipipe.stagekit.stage import StageInputError, StageJob
from tests.harness.pictures import picture, png_base64
from tests.unit.test_flux import PIXEL_TOLERANCE, reference
from tests.unit.test_flux_kontext import MODEL, WIDE, stage

pytestmark = pytest.mark.timeout(600)
# The edited area: a box of the 96x64 input, transparent in OpenAI's mask.
BOX = (24, 8, 72, 40)
# A 96x64 input is made at its trained size, 1248x832, when masked.
MADE = (1248, 832)


def openai_mask(size: tuple[int, int] = WIDE.size, mode: str = "RGBA") -> str:
    """OpenAI's mask: opaque, but for BOX fully transparent and a half-transparent strip
    (kept: only alpha 0 is edited)."""
    mask = Image.new("RGBA", size, (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), BOX)
    mask.paste((0, 0, 0, 128), (0, 48, size[0], 56))
    buf = io.BytesIO()
    mask.convert(mode).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def diffusers_mask() -> Image.Image:
    """The same edit as diffusers' mask_image: white where it repaints, black elsewhere."""
    mask = Image.new("L", WIDE.size, 0)
    mask.paste(255, BOX)
    return mask


def inpaint_pipe() -> Any:
    from diffusers import FluxKontextInpaintPipeline

    pipe = FluxKontextInpaintPipeline.from_pretrained(resolve_model_path(MODEL))
    pipe.set_progress_bar_config(disable=True)
    return pipe


BASE = {"width": MADE[0], "height": MADE[1], "guidance_scale": 2.5, "images": [png_base64(WIDE)]}
MASKED = {**BASE, "prompt": "make it blue", "seed": 1, "n": 2, "num_inference_steps": 3}
MASKED["mask"] = openai_mask()
# The same edit but one image and no mask, in the same batch: the mask is per row.
UNMASKED = {**BASE, "prompt": "make it blue", "seed": 1, "num_inference_steps": 3}


@pytest.fixture(scope="module")
def split() -> list[np.ndarray]:
    encode, image, denoise, decode = (
        stage(n) for n in ("encode", "encode-image", "denoise", "decode")
    )
    requests = (MASKED, UNMASKED)
    jobs = [
        StageJob(
            p,
            {
                "encode": encode.run(StageJob(p, {})).tensors,
                "encode-image": image.run(StageJob(p, {})).tensors,
            },
        )
        for p in requests
    ]
    assert "mask" in jobs[0].inputs["encode-image"]
    assert "mask" not in jobs[1].inputs["encode-image"]
    assert len({denoise.batch_key(j) for j in jobs}) == 1
    results = denoise.run_batch(jobs)
    return [
        decode.pixels(StageJob(p, {"denoise": r.tensors}))
        for p, r in zip(requests, results, strict=True)
    ]


def test_a_masked_edit_equals_diffusers_kontext_inpaint_pipeline(split: list[np.ndarray]) -> None:
    """Each of its two images equals the pipeline's for its seed (seed + i, as one call of
    num_images_per_prompt=2 draws them: its latents are these to 5e-7), one image a call:
    the pipeline decodes a batch in one VAE call, whose mid-block attention over 1248x832
    rounds otherwise at batch 2 (the decode stage decodes one image at a time)."""
    masked, unmasked = split
    pipe = inpaint_pipe()
    expected = np.concatenate(
        [
            pipe(
                image=WIDE,
                mask_image=diffusers_mask(),
                prompt=MASKED["prompt"],
                num_inference_steps=MASKED["num_inference_steps"],
                guidance_scale=MASKED["guidance_scale"],
                generator=[torch.Generator().manual_seed(1 + i)],
                output_type="np",
            ).images
            for i in range(2)
        ]
    )
    assert masked.shape == expected.shape == (2, MADE[1], MADE[0], 3)
    np.testing.assert_allclose(masked, expected, rtol=0, atol=PIXEL_TOLERANCE)
    # The mask changed the edit: its unmasked twin (same prompt and seed) differs.
    assert np.abs(masked[0] - unmasked[0]).max() > 0.01
    assert np.abs(masked[0] - masked[1]).max() > 0.01


def test_an_unmasked_edit_in_the_same_batch_equals_diffusers_kontext(
    split: list[np.ndarray],
) -> None:
    params = {k: v for k, v in UNMASKED.items() if k != "images"}
    expected = reference(MODEL, params, image=WIDE, max_area=MADE[0] * MADE[1])
    assert split[1].shape == expected.shape == (1, MADE[1], MADE[0], 3)
    np.testing.assert_allclose(split[1], expected, rtol=0, atol=PIXEL_TOLERANCE)


def test_openai_mask_becomes_diffusers_mask_as_its_own_processing_reads_it() -> None:
    """alpha 0 -> repaint, any other alpha (the half-transparent strip too) -> keep; on the
    latent grid and packed, equal to FluxKontextInpaintPipeline's mask_processor and
    prepare_mask_latents given the white-is-repaint mask."""
    pipe = inpaint_pipe()
    width, height = MADE
    grid = latent_mask(pipe, decode_mask(openai_mask(), WIDE.size), width, height)
    ours = pack_mask(grid, 16)
    processed = pipe.mask_processor.preprocess(diffusers_mask(), height=height, width=width)
    latents = torch.zeros(1, 16, height // 8, width // 8)  # 16 channels: no VAE encode
    theirs, _ = pipe.prepare_mask_latents(
        processed, latents, 1, 16, 1, height, width, torch.float32, torch.device("cpu"), None
    )
    assert ours.shape == theirs.shape == (1, (height // 16) * (width // 16), 64)
    assert torch.equal(ours, theirs)
    # Not all one value: the box is repainted (1), the rest kept (0), the strip included.
    rows, columns = height // 8, width // 8
    assert grid.shape == (1, 1, rows, columns)
    assert grid[0, 0, rows * 24 // 64, columns * 48 // 96] == 1  # inside BOX
    assert grid[0, 0, rows * 52 // 64, columns * 48 // 96] == 0  # the strip, alpha 128
    assert grid[0, 0, 0, 0] == 0


def test_the_routers_size_of_a_masked_edit_is_the_one_diffusers_makes() -> None:
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    assert list(KONTEXT_RESOLUTIONS) == PREFERRED_KONTEXT_RESOLUTIONS
    assert EXTENSIONS.masked_edit_size(*WIDE.size) == MADE == kontext_size(*WIDE.size)
    # Sides floored to 16 before the ratio, as get_default_height_width does: 100x70 is
    # read as 96x64 (3:2), not 1.43:1 (1184x880's ratio is nearer that).
    assert kontext_size(100, 70) == MADE
    assert kontext_size(64, 64) == (1024, 1024)
    assert kontext_size(64, 96) == (832, 1248)


@pytest.mark.parametrize(
    ("mask", "words"),
    [
        (openai_mask((64, 64)), "not the image's 96x64"),
        (openai_mask(mode="RGB"), "alpha channel"),
        (png_base64(picture(96, 64)), "alpha channel"),
        ("bm90IGFuIGltYWdl", "not a decodable PNG"),
    ],
)
def test_a_bad_mask_is_refused_naming_it(mask: str, words: str) -> None:
    with pytest.raises(StageInputError, match=words) as refused:
        stage("encode-image").run(StageJob({**BASE, "mask": mask}, {}))
    assert refused.value.param == "mask"


def test_a_masked_edit_at_another_size_is_refused_naming_size() -> None:
    image, denoise = stage("encode-image"), stage("denoise")
    text = {"prompt_embeds": torch.zeros(1, 512, 32), "pooled_prompt_embeds": torch.zeros(1, 32)}
    inputs = image.run(StageJob(MASKED, {})).tensors
    params = {**MASKED, "width": 64, "height": 48}
    with pytest.raises(StageInputError, match="trained size, 1248x832") as refused:
        denoise.begin(StageJob(params, {"encode": text, "encode-image": inputs}))
    assert refused.value.param == "size"


def test_an_input_under_16_pixels_a_side_is_refused_naming_it() -> None:
    """Masked or not: diffusers' aspect ratio of its trained sizes would divide by zero."""
    narrow = {**UNMASKED, "images": [png_base64(picture(96, 8))]}
    with pytest.raises(StageInputError, match="at least 16 pixels a side, got 96x8") as refused:
        stage("encode-image").run(StageJob(narrow, {}))
    assert refused.value.param == "image"
