"""FLUX.2 reference-image editing: tiny://flux2-dev under flux2-edit and tiny://flux2-klein-base
and tiny://flux2-klein under flux2-klein-edit (the text-to-image checkpoints) split into
four stages equal diffusers' one-process Flux2Pipeline and Flux2KleinPipeline called with
`image=[...]`: the same pixels, within float rounding of another batch shape, for edits
with one reference and with two, denoised in one batch with their own prompts, seeds,
steps, guidance, negative prompts and image counts (one joining the batch after its
first step), a reference over a megapixel brought down as the pipeline brings it; the
references' positions are the pipeline's; edits whose references differ in grid never
share a batch; a LoRA adapter and int8 weights apply to edits as to text to image; and
what an edit cannot take is refused by name."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omnipipe.families.flux2.edit import Flux2ReferenceEncodeStage
from omnipipe.stagekit.stage import StageInputError, StageJob
from tests.harness.pictures import picture, png_base64
from tests.unit.test_flux2 import (
    DEV,
    KLEIN,
    KLEIN_BASE,
    PIXEL_TOLERANCE,
    loaded,
    one_process,
    pipeline_images,
)

pytestmark = pytest.mark.timeout(600)
EDIT = {DEV: "flux2-edit", KLEIN_BASE: "flux2-klein-edit", KLEIN: "flux2-klein-edit"}
WIDE, TALL, SQUARE = picture(96, 64), picture(64, 80, (30, 30, 200)), picture(64, 64)
BASE = {"width": 64, "height": 48, "num_inference_steps": 3}
ONE = {**BASE, "images": [png_base64(WIDE)]}
TWO = {**BASE, "images": [png_base64(WIDE), png_base64(TALL)]}
# Per model, batches of edits that share their references: each batch is denoised
# together, the last edit of each joining after the others' first step.
BATCHES: dict[str, list[list[dict[str, Any]]]] = {
    DEV: [
        [
            {**ONE, "prompt": "make it blue", "guidance_scale": 4.0, "seed": 1},
            {**ONE, "prompt": "a hat on it", "guidance_scale": 6.0, "seed": 2, "n": 2},
        ],
        [
            {**TWO, "prompt": "the cat of image 1 on the sofa of image 2", "seed": 3},
            {**TWO, "prompt": "both at night", "guidance_scale": 2.5, "num_inference_steps": 2},
        ],
    ],
    KLEIN_BASE: [
        [
            {**ONE, "prompt": "a boat", "guidance_scale": 4.0, "seed": 1, "negative_prompt": "fog"},
            {**ONE, "prompt": "a cat", "guidance_scale": 1.0, "seed": 2, "n": 2},
        ],
        [
            {**TWO, "prompt": "one scene", "guidance_scale": 3.0, "seed": 4},
            {**TWO, "prompt": "two cats", "guidance_scale": 1.0, "num_inference_steps": 2},
        ],
    ],
    KLEIN: [
        [{**ONE, "prompt": "a cat", "seed": 3}],
        [
            {**TWO, "prompt": "a cat", "seed": 3},
            {**TWO, "prompt": "a dog", "seed": 5, "n": 2},
        ],
    ],
}


def loaded_edit(model: str, name: str, **spec: Any) -> Any:
    """The stage as the worker loads it for the model's edit pipeline type."""
    return loaded(model, name, pipeline=EDIT[model], **spec)


@functools.cache
def stage(model: str, name: str) -> Any:
    """The edit stage with nothing more in its spec, once per test session."""
    return loaded_edit(model, name)


def decoded(params: dict[str, Any]) -> list[Image.Image]:
    from omnipipe.stagekit.media import decode_image

    return [decode_image(data, "image") for data in params["images"]]


def reference(model: str, params: dict[str, Any], pipe: Any = None) -> np.ndarray:
    """The checkpoint's own pipeline's images for the edit `params` (its references as
    the PIL images the request's PNGs hold)."""
    return pipeline_images(pipe or one_process(model), params, image=decoded(params))


def inputs(model: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        name: stage(model, name).run(StageJob(params, {})).tensors
        for name in ("encode", "encode-image")
    }


def denoised_joining(denoise: Any, jobs: list[StageJob]) -> list[Any]:
    """The jobs through one batch, the last joining after the others' first step, as the
    worker lets a request join a running batch."""
    states = [denoise.begin(job) for job in jobs[:-1]]
    if states:
        denoise.step(states)
    states.append(denoise.begin(jobs[-1]))
    while running := [s for s in states if not denoise.finished(s)]:
        denoise.step(running)
    return [denoise.finish(s) for s in states]


@pytest.mark.parametrize("model", [DEV, KLEIN_BASE, KLEIN])
def test_the_split_edit_equals_diffusers_with_one_and_two_references(model: str) -> None:
    denoise, decode = stage(model, "denoise"), stage(model, "decode")
    for batch in BATCHES[model]:
        jobs = [StageJob(p, inputs(model, p)) for p in batch]
        assert len({denoise.batch_key(j) for j in jobs}) == 1
        results = denoised_joining(denoise, jobs)
        images = []
        for params, result in zip(batch, results, strict=True):
            got = decode.pixels(StageJob(params, {"denoise": result.tensors}))
            expected = reference(model, params)
            assert got.shape == expected.shape == (params.get("n", 1), 48, 64, 3)
            np.testing.assert_allclose(got, expected, rtol=0, atol=PIXEL_TOLERANCE)
            images.append(got[0])
        # Not noise against noise: the edits differ from each other; and the references
        # are seen: the same request without them (text to image) is another image, by
        # far more than the tolerance above (random tiny weights heed them faintly).
        assert all(np.abs(a - b).max() > 0.01 for a in images for b in images if a is not b)
        plain = {"encode": jobs[0].inputs["encode"]}
        [t2i] = denoise.run_batch([StageJob(batch[0], plain)])
        t2i_pixels = decode.pixels(StageJob(batch[0], {"denoise": t2i.tensors}))
        assert np.abs(t2i_pixels[0] - images[0]).max() > 10 * PIXEL_TOLERANCE


def test_a_reference_over_a_megapixel_is_brought_down_as_the_pipeline_does() -> None:
    big = picture(1100, 1000, (40, 160, 90))
    params = {
        **BASE,
        "images": [png_base64(big)],
        "prompt": "a lighthouse",
        "num_inference_steps": 2,
        "seed": 9,
    }
    tensors = inputs(DEV, params)
    # LANCZOS to 1073x976 (a megapixel), cropped to 1072x976: 67 x 61 tokens.
    assert tuple(tensors["encode-image"]["image_latents"].shape) == (1, 61 * 67, 128)
    [result] = stage(DEV, "denoise").run_batch([StageJob(params, tensors)])
    got = stage(DEV, "decode").pixels(StageJob(params, {"denoise": result.tensors}))
    np.testing.assert_allclose(got, reference(DEV, params), rtol=0, atol=PIXEL_TOLERANCE)


def test_each_reference_has_its_own_time_position_as_in_the_pipeline() -> None:
    """96x64 is 6 x 4 tokens at time 10, 64x80 4 x 5 at time 20: the pipeline's own
    _prepare_image_ids, and its packed latents."""
    encode_image = stage(DEV, "encode-image")
    assert type(encode_image) is Flux2ReferenceEncodeStage
    tensors = encode_image.run(StageJob(TWO, {})).tensors
    ids = tensors["image_ids"]
    assert ids.shape == (24 + 20, 4)
    first, second = ids[:24], ids[24:]
    assert set(first[:, 0].tolist()) == {10}
    assert set(second[:, 0].tolist()) == {20}
    assert (int(first[:, 1].max()), int(first[:, 2].max())) == (3, 5)
    assert (int(second[:, 1].max()), int(second[:, 2].max())) == (4, 3)
    pipe = one_process(DEV)
    pixels = [
        pipe.image_processor.preprocess(im, height=im.height, width=im.width, resize_mode="crop")
        for im in (WIDE, TALL)
    ]
    latents, expected_ids = pipe.prepare_image_latents(pixels, 1, None, "cpu", torch.float32)
    torch.testing.assert_close(tensors["image_latents"], latents, rtol=0, atol=1e-6)
    assert torch.equal(ids, expected_ids[0])


def test_edits_whose_references_differ_in_grid_never_share_a_batch() -> None:
    """Not even of one token count: two references swapped, or transposed."""
    encode_image, denoise = stage(DEV, "encode-image"), stage(DEV, "denoise")
    text = {"prompt_embeds": torch.zeros(1, 512, 48)}

    def key(*pictures: Image.Image) -> object:
        params = {**BASE, "images": [png_base64(p) for p in pictures]}
        refs = encode_image.run(StageJob(params, {})).tensors
        return denoise.batch_key(StageJob(BASE, {"encode": text, "encode-image": refs}))

    wide_tall = key(WIDE, TALL)
    others = {key(TALL, WIDE), key(picture(64, 96)), key(WIDE), key(SQUARE), wide_tall}
    assert len(others) == 5
    assert key(picture(96, 64, (0, 0, 0)), TALL) == wide_tall  # other pixels, same grids
    assert denoise.batch_key(StageJob(BASE, {"encode": text})) not in others


def test_a_lora_adapter_and_int8_weights_apply_to_edits() -> None:
    """The adapter's edit equals Flux2Pipeline's with load_lora_weights at that scale;
    int8 weights stay near full precision."""
    from diffusers import DiffusionPipeline
    from torchao.utils import TorchAOBaseTensor

    from omnipipe.checkpoints.tiny import resolve_model_path

    source = str(resolve_model_path("tiny://flux2-dev-lora"))
    adapters = [{"name": "ink", "source": source, "stage": "denoise"}]
    params = {**TWO, "prompt": "make it blue", "seed": 5}
    edit = StageJob(params, inputs(DEV, params))
    lora = StageJob({**params, "lora": {"name": "ink", "scale": 0.7}}, edit.inputs)
    [with_lora] = loaded_edit(DEV, "denoise", adapters=adapters).run_batch([lora])
    got = stage(DEV, "decode").pixels(StageJob(params, {"denoise": with_lora.tensors}))
    pipe: Any = DiffusionPipeline.from_pretrained(resolve_model_path(DEV))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(source, adapter_name="ink")
    pipe.set_adapters(["ink"], adapter_weights=[0.7])
    expected = reference(DEV, params, pipe)
    np.testing.assert_allclose(got, expected, rtol=0, atol=PIXEL_TOLERANCE)
    assert np.abs(got - reference(DEV, params)).max() > 0.01  # the adapter changed it

    stages = [{"name": "denoise", "acceleration": {"quantization": {"method": "int8-weight-only"}}}]
    quantized = loaded_edit(DEV, "denoise", stages=stages)
    assert all(
        isinstance(m.weight, TorchAOBaseTensor)
        for m in quantized.pipe.transformer.modules()
        if isinstance(m, torch.nn.Linear)
    )
    [full] = stage(DEV, "denoise").run_batch([edit])
    [int8] = quantized.run_batch([edit])
    a, b = full.tensors["latents"], int8.tensors["latents"]
    error = float((b - a).norm() / a.norm())
    assert 0 < error < 0.01, f"relative error {error:.4f}"


@pytest.mark.parametrize(
    ("model", "count", "words"),
    [
        (DEV, 11, "FLUX.2 dev edits with at most 10 reference images, got 11"),
        (KLEIN, 5, "FLUX.2 klein edits with at most 4 reference images, got 5"),
        (DEV, 0, "a reference image is required"),
    ],
)
def test_more_references_than_the_model_takes_are_refused(
    model: str, count: int, words: str
) -> None:
    params = {**BASE, "images": [png_base64(SQUARE)] * count}
    with pytest.raises(StageInputError, match=words) as refused:
        stage(model, "encode-image").run(StageJob(params, {}))
    assert refused.value.param == "image"


@pytest.mark.parametrize(
    ("small", "words"),
    [
        (picture(64, 48), r"Image too small: 64\S48\. Both dimensions must be at least 64px"),
        (picture(576, 64), "Aspect ratio too extreme"),
    ],
)
def test_a_reference_the_pipeline_refuses_is_refused_naming_it(
    small: Image.Image, words: str
) -> None:
    params = {**BASE, "images": [png_base64(SQUARE), png_base64(small)]}
    with pytest.raises(StageInputError, match=words) as refused:
        stage(DEV, "encode-image").run(StageJob(params, {}))
    assert refused.value.param == "image[1]"
    assert str(refused.value).startswith("image[1]: ")


def test_an_edit_on_dev_refuses_a_negative_prompt_by_name() -> None:
    params = {**ONE, "prompt": "x", "negative_prompt": "blurry"}
    with pytest.raises(StageInputError, match=r"FLUX\.2 dev takes no negative prompt"):
        stage(DEV, "encode").run(StageJob(params, {}))
