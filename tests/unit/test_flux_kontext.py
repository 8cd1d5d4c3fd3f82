"""tiny://flux1-kontext split into four stages equals diffusers' FluxKontextPipeline: the
same pixels (within float rounding of another batch shape) for edits of one input image
denoised in one batch with their own prompts, seeds, steps, guidance and image counts.
The input's tokens ride after the noise's, so only edits of inputs of one trained size
share a batch; Kontext edits one image."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.stagekit.stage import StageInputError, StageJob
from tests.harness.pictures import picture, png_base64
from tests.unit.test_flux import PIXEL_TOLERANCE, loaded, reference

pytestmark = pytest.mark.timeout(600)
MODEL = "tiny://flux1-kontext"


WIDE = picture(96, 64)
BASE = {"width": 64, "height": 48, "num_inference_steps": 3, "images": [png_base64(WIDE)]}
REQUESTS = [
    {**BASE, "prompt": "make it blue", "guidance_scale": 2.5, "seed": 1},
    {**BASE, "prompt": "a hat on it", "guidance_scale": 5.0, "seed": 2, "n": 2},
    {**BASE, "prompt": "at night", "guidance_scale": 1.0, "num_inference_steps": 2},
]


def stage(name: str) -> Any:
    return loaded(MODEL, name, pipeline="flux-kontext")


@pytest.fixture(scope="module")
def split() -> list[np.ndarray]:
    """Each edit through the four stages, denoised in one batch."""
    encode, image, denoise, decode = (
        stage(n) for n in ("encode", "encode-image", "denoise", "decode")
    )
    jobs = [
        StageJob(
            p,
            {
                "encode": encode.run(StageJob(p, {})).tensors,
                "encode-image": image.run(StageJob(p, {})).tensors,
            },
        )
        for p in REQUESTS
    ]
    assert len({denoise.batch_key(j) for j in jobs}) == 1
    results = denoise.run_batch(jobs)
    return [
        decode.pixels(StageJob(p, {"denoise": r.tensors}))
        for p, r in zip(REQUESTS, results, strict=True)
    ]


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_the_split_graph_equals_diffusers_kontext_pipeline(split: list[np.ndarray], i: int) -> None:
    # max_area is the size asked: diffusers' pipeline scales its output to that area.
    params = REQUESTS[i]
    expected = reference(MODEL, params, image=WIDE, max_area=params["width"] * params["height"])
    assert split[i].shape == expected.shape == (REQUESTS[i].get("n", 1), 48, 64, 3)
    np.testing.assert_allclose(split[i], expected, rtol=0, atol=PIXEL_TOLERANCE)
    others = [im[0] for j, im in enumerate(split) if j != i]
    assert all(np.abs(split[i][0] - o).max() > 0.01 for o in others)


def test_the_input_is_encoded_at_its_nearest_trained_size() -> None:
    """96x64 (3:2) is nearest 1248x832: 78 x 52 tokens, their first position axis 1."""
    tensors = stage("encode-image").run(StageJob(REQUESTS[0], {})).tensors
    assert tuple(tensors["image_latents"].shape) == (1, 52 * 78, 64)
    ids = tensors["image_ids"]
    assert ids.shape == (52 * 78, 3)
    assert bool((ids[:, 0] == 1).all())
    assert (int(ids[:, 1].max()), int(ids[:, 2].max())) == (51, 77)


def test_edits_of_inputs_of_other_sizes_never_share_a_batch() -> None:
    """Not even of one token count: a portrait and a landscape input of transposed trained
    sizes (832x1248, 1248x832) place their tokens otherwise."""
    image, denoise = stage("encode-image"), stage("denoise")
    text = {"prompt_embeds": torch.zeros(1, 512, 32), "pooled_prompt_embeds": torch.zeros(1, 32)}

    def key(picture_of: Any) -> object:
        params = {**BASE, "images": [png_base64(picture_of)]}
        inputs = image.run(StageJob(params, {})).tensors
        return denoise.batch_key(StageJob(BASE, {"encode": text, "encode-image": inputs}))

    wide, tall, square = key(picture(96, 64)), key(picture(64, 96)), key(picture(64, 64))
    assert len({wide, tall, square}) == 3
    assert key(picture(192, 128)) == wide  # another input of the same trained size


@pytest.mark.parametrize("images", [[], [png_base64(WIDE)] * 2, "x"])
def test_kontext_edits_one_image(images: Any) -> None:
    with pytest.raises(StageInputError, match="edits one image") as refused:
        stage("encode-image").run(StageJob({**BASE, "images": images}, {}))
    assert refused.value.param == "image"
