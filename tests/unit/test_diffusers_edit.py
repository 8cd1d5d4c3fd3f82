"""The diffusers fallback's edit type (`pipeline: diffusers-edit`) on tiny://sd3, a
text-to-image checkpoint: with a mask it runs StableDiffusion3InpaintPipeline, without
one StableDiffusion3Img2ImgPipeline, each row the image diffusers' own class makes for its
seed alone; OpenAI's mask edits where it is transparent; a checkpoint whose class edits
runs as it is; a class that cannot edit is refused by name; bad inputs and fields are 400s
naming them."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omnipipe.api.families import RequestProblem
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.diffusers_any.edit import WholeEditStage
from omnipipe.families.diffusers_any.edit_requests import EXTENSIONS
from omnipipe.stagekit.stage import StageInputError, StageJob
from tests.harness.fallback import cancelled_at_first_step, fallback_stage
from tests.harness.pictures import broken_png, picture, png_base64
from tests.harness.usage import expected_usage

pytestmark = pytest.mark.timeout(300)
# Float rounding: one call of several rows against diffusers' call of one.
PIXEL_TOLERANCE = 1e-4
# The edited region of the 64x48 input: its left half, 4 of the 8 latent columns (SD3's
# VAE is 8x down), so that the mask on the latent grid has no partly covered latent.
EDITED_COLUMNS = 32
LATENT = 8


def edit_stage(model: str) -> WholeEditStage:
    return fallback_stage(model, "diffusers-edit", WholeEditStage)


@pytest.fixture(scope="module")
def stage() -> WholeEditStage:
    loaded = edit_stage("tiny://sd3")
    loaded.load()
    return loaded


def openai_mask(width: int, height: int) -> Image.Image:
    """OpenAI's mask: the left EDITED_COLUMNS fully transparent (edit); the rest kept,
    its lower half only just opaque (alpha 1 is kept too: only alpha 0 edits)."""
    alpha = np.full((height, width), 255, np.uint8)
    alpha[height // 2 :, :] = 1
    alpha[:, :EDITED_COLUMNS] = 0
    rgba = np.zeros((height, width, 4), np.uint8)
    rgba[..., 3] = alpha
    return Image.fromarray(rgba, mode="RGBA")


def diffusers_mask(width: int, height: int) -> Image.Image:
    """The same region as diffusers marks it: white is repainted."""
    repaint = np.zeros((height, width), np.uint8)
    repaint[:, :EDITED_COLUMNS] = 255
    return Image.fromarray(repaint, mode="L")


def png(image: Image.Image, kind: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=kind)
    return base64.b64encode(buf.getvalue()).decode()


def request(**params: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "prompt": "a red door",
        "images": [png_base64(picture(64, 48))],
        "width": 64,
        "height": 48,
        "num_inference_steps": 4,
        "guidance_scale": 5.0,
        "strength": 0.75,
        "seed": 3,
    }
    return {**base, **params}


MASKED = [
    request(mask=png(openai_mask(64, 48)), negative_prompt="blurry", n=2),
    request(mask=png(openai_mask(64, 48)), negative_prompt="dark", prompt="a blue sky", seed=11),
]
# No size: each its input's, rounded down to SD3's multiple of 16 (70x50 -> 64x48, 40x72
# -> 32x64); strength and guidance left to the pipeline (0.6 and 7.0).
MADE_AT = [EXTENSIONS.edit_size(70, 50), EXTENSIONS.edit_size(40, 72)]
UNMASKED = [
    request(images=[png_base64(picture(70, 50))], width=MADE_AT[0][0], height=MADE_AT[0][1],
            strength=None, guidance_scale=None, num_inference_steps=5),
    request(images=[png_base64(picture(40, 72, (30, 30, 200)))], width=MADE_AT[1][0],
            height=MADE_AT[1][1], strength=None, guidance_scale=None, num_inference_steps=5,
            prompt="a cat", seed=7),
]  # fmt: skip


def own_images(pipe: Any, params: dict[str, Any], size: tuple[int, int]) -> np.ndarray:
    """diffusers' own images for one request, each row called alone with its seed; the
    settings the request leaves unset left out, as the pipeline's defaults."""
    image = Image.open(io.BytesIO(base64.b64decode(params["images"][0])))
    call = {k: params[k] for k in ("guidance_scale", "strength") if params[k] is not None}
    if "mask" in params:
        call["mask_image"] = diffusers_mask(*image.size)
    if params.get("negative_prompt"):
        call["negative_prompt"] = params["negative_prompt"]
    rows = []
    for i in range(params.get("n", 1)):
        with torch.inference_mode():
            rows.append(
                pipe(
                    prompt=params["prompt"],
                    image=image.convert("RGB"),
                    width=size[0],
                    height=size[1],
                    num_inference_steps=params["num_inference_steps"],
                    generator=torch.Generator().manual_seed(params["seed"] + i),
                    output_type="np",
                    **call,
                ).images[0]
            )
    return np.stack(rows)


def test_masked_and_unmasked_edits_equal_diffusers_own_pipelines(stage: WholeEditStage) -> None:
    from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline

    path = resolve_model_path("tiny://sd3")
    inpaint = StableDiffusion3InpaintPipeline.from_pretrained(path)
    img2img = StableDiffusion3Img2ImgPipeline.from_pretrained(path)
    for pipe in (inpaint, img2img):
        pipe.set_progress_bar_config(disable=True)
    masked = [StageJob(dict(p), {}) for p in MASKED]
    unmasked = [StageJob(dict(p), {}) for p in UNMASKED]
    assert len({stage.batch_key(j) for j in masked}) == 1
    # Two sizes: never one call.
    assert len({stage.batch_key(j) for j in unmasked}) == 2
    assert stage.batch_key(masked[0]) != stage.batch_key(StageJob(request(), {}))
    steps: list[tuple[int, int]] = []
    masked[1].on_step = lambda step, total: steps.append((step, total))
    cases = [
        (MASKED, stage.images(masked, "np"), inpaint, [(64, 48)] * 2),
        (UNMASKED, [y for j in unmasked for y in stage.images([j], "np")], img2img, MADE_AT),
    ]
    for requests, made, pipe, sizes in cases:
        for params, images, (width, height) in zip(requests, made, sizes, strict=True):
            assert images is not None
            ours, own = np.stack(images), own_images(pipe, params, (width, height))
            assert ours.shape == own.shape == (params.get("n", 1), height, width, 3)
            assert np.abs(ours - own).max() <= PIXEL_TOLERANCE
    # Strength 0.75 of 4 steps runs the last 3, and each is reported.
    assert steps == [(1, 3), (2, 3), (3, 3)]
    first = cases[0][1][0]
    assert first is not None
    assert np.abs(first[0] - first[1]).max() > 0.01  # each row its own seed


def test_an_edits_usage_counts_its_text_its_input_and_its_images(stage: WholeEditStage) -> None:
    [result] = stage.run_batch([StageJob(dict(MASKED[0]), {})])
    assert len(result.outputs) == 2
    # 64x48 is 8x6 latents (SD3's VAE is 8x down), 4x3 of its DiT's 2x2 patches: the
    # input (resized to the output's size) and each of the two images.
    text = expected_usage("tiny://sd3", ["a red door", "blurry"], 0)["input_tokens"]
    assert result.usage == {"text_tokens": text, "image_tokens": 12, "output_tokens": 2 * 12}


def test_what_changes_is_where_openais_mask_is_transparent(stage: WholeEditStage) -> None:
    """The inpainting pipeline puts the input's latents back outside its mask after every
    step, so that on the latent grid the kept region is the input's whatever the prompt,
    and the transparent region is the prompt's. (In pixels the VAE's decoder mixes every
    latent into every pixel, so no pixel is promised unchanged.)"""
    jobs = [
        StageJob(request(mask=png(openai_mask(64, 48)), prompt=prompt), {})
        for prompt in ("a red door", "a field of snow")
    ]
    first, second = (torch.stack(list(made or ())) for made in stage.images(jobs, "latent"))
    edited = EDITED_COLUMNS // LATENT
    assert first.shape == (1, 16, 48 // LATENT, 64 // LATENT)
    assert torch.equal(first[..., edited:], second[..., edited:])
    assert (first[..., :edited] - second[..., :edited]).abs().max() > 0.01


def test_a_text_to_image_checkpoint_edits_as_autopipeline_maps_it(stage: WholeEditStage) -> None:
    from diffusers import (
        StableDiffusion3Img2ImgPipeline,
        StableDiffusion3InpaintPipeline,
        StableDiffusion3Pipeline,
    )

    assert type(stage.pipe) is StableDiffusion3Pipeline
    assert type(stage.pipes[True]) is StableDiffusion3InpaintPipeline
    assert type(stage.pipes[False]) is StableDiffusion3Img2ImgPipeline
    # One set of weights.
    assert stage.pipes[True].transformer is stage.pipes[False].transformer is stage.pipe.transformer


def test_a_checkpoint_whose_class_edits_runs_as_it_is() -> None:
    """FLUX.1 Kontext's class takes an input image and no mask: it is the one pipeline,
    and a mask or a strength, which it does not take, is a 400 naming the field."""
    from diffusers import FluxKontextPipeline

    kontext = edit_stage("tiny://flux1-kontext")
    kontext.load()
    assert list(kontext.pipes) == [False]
    assert type(kontext.pipes[False]) is FluxKontextPipeline is type(kontext.pipe)
    with pytest.raises(StageInputError, match="FluxKontextPipeline edits the whole") as masked:
        kontext.images([StageJob(request(mask=png(openai_mask(64, 48))), {})], "np")
    with pytest.raises(StageInputError, match="FluxKontextPipeline takes no strength") as strong:
        kontext.images([StageJob(request(), {})], "np")
    assert (masked.value.param, strong.value.param) == ("mask", "strength")


@pytest.mark.parametrize(
    ("model", "refused"),
    [
        (
            "tiny://sana",
            "SanaPipeline makes images from text, and diffusers has no image-to-image or "
            "inpainting pipeline for it .*: serve it as pipeline diffusers",
        ),
        ("tiny://wan", "WanPipeline makes videos: serve it as pipeline diffusers-video"),
    ],
)
def test_a_class_that_cannot_edit_is_refused_by_name(model: str, refused: str) -> None:
    with pytest.raises(NotImplementedError, match=refused):
        edit_stage(model).load()


def test_bad_inputs_are_the_clients_errors_naming_the_field(stage: WholeEditStage) -> None:
    opaque = png(Image.new("RGB", (64, 48)), "JPEG")
    cases = {
        "mask": [
            "not base64!",
            opaque,
            png(openai_mask(32, 32)),
            base64.b64encode(broken_png(64, 48)).decode(),
        ],
        "image": [
            [base64.b64encode(b"\x89PNG\r\n\x1a\nnot a png").decode()],
            [png_base64(picture(64, 48))] * 2,
        ],
    }
    for field, values in cases.items():
        for value in values:
            params = request(**({"mask": value} if field == "mask" else {"images": value}))
            with pytest.raises(StageInputError) as refused:
                stage.images([StageJob(params, {})], "np")
            assert refused.value.param == field, refused.value.message
    # With no size, an input too small for the sides every pipeline takes (multiples of 16).
    with pytest.raises(RequestProblem, match="at least 16 pixels a side") as too_small:
        EXTENSIONS.edit_size(8, 40)
    assert too_small.value.param == "image"


def test_the_edit_fields_and_the_other_endpoints() -> None:
    """Unset settings are left to the pipeline and the input (None); `strength` is read
    as a form sends it and checked; the image and chat APIs point to the edit API."""
    unset = EXTENSIONS.edit_params({"prompt": "x"})
    assert unset == dict.fromkeys(("num_inference_steps", "guidance_scale", "strength"))
    # No size: the input's, each side down to a multiple of 16, the longer at most 2048.
    assert EXTENSIONS.edit_size(70, 50) == (64, 48)
    assert EXTENSIONS.edit_size(40, 72) == (32, 64)
    assert EXTENSIONS.edit_size(4096, 3000) == (2048, 1488)
    assert EXTENSIONS.edit_params({"size": "64x48", "num_inference_steps": 4,
                                   "guidance_scale": 2.0, "strength": "0.25"}) == {
        "strength": 0.25
    }  # fmt: skip
    assert EXTENSIONS.edit_params({"size": "auto", "strength": 1})["strength"] == 1.0
    for bad in ("0", "1.5", "-0.2", "abc", "1_0", " 0.5", "nan", True, [0.5]):
        with pytest.raises(RequestProblem) as refused:
            EXTENSIONS.edit_params({"strength": bad})
        assert refused.value.param == "strength"
    for call in (
        lambda: EXTENSIONS.image_params({"prompt": "x"}),
        lambda: EXTENSIONS.chat_image_params({}, lambda size: (1, 1)),
    ):
        with pytest.raises(RequestProblem, match="POST /v1/images/edits"):
            call()


def test_a_call_whose_requests_are_all_cancelled_stops(stage: WholeEditStage) -> None:
    params = request(mask=png(openai_mask(64, 48)), num_inference_steps=20)
    result, steps = cancelled_at_first_step(stage, params)
    assert result.outputs == []
    assert steps == [(1, 15)]  # strength 0.75 of 20: the other 14 were skipped
