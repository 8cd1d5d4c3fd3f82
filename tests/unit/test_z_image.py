"""tiny://z-image and tiny://z-image-turbo split into three stages equal diffusers'
one-process ZImagePipeline: the same pixels, within float rounding of another batch
shape, for requests denoised in one batch with their own seeds, step counts, image counts,
caption lengths and guidance, with CFG (a negative prompt, or the empty one; the
pipeline's normalisation and truncation) and without (guidance 0, Turbo's); requests
joining a running batch get what they get alone; a LoRA adapter as diffusers' own loading
applies it, int8 weights near full precision (the step cache: test_z_image_cache.py);
and the request fields Z-Image does not take are refused by name."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.api import parse_resource, resolve
from omnipipe.api.families import RequestProblem
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.z_image.requests import EXTENSIONS
from omnipipe.stagekit.stage import StageInputError, StageJob
from omnipipe.worker.stage_classes import stage_class

pytestmark = pytest.mark.timeout(600)
BASE = {"width": 64, "height": 48, "num_inference_steps": 4}
LONG = "a dog on a beach at noon, waves breaking, gulls overhead, a red kite in the sky"
REQUESTS = [
    {**BASE, "prompt": "a lighthouse at dusk", "guidance_scale": 4.0, "seed": 1,
     "negative_prompt": "blurry, low quality"},
    {**BASE, "prompt": "a cat", "guidance_scale": 0.0, "seed": 2, "n": 2,
     "num_inference_steps": 3},
    {**BASE, "prompt": LONG, "guidance_scale": 2.5, "seed": 3, "n": 2,
     "cfg_normalization": 1.0, "cfg_truncation": 0.1},
]  # fmt: skip
# Float rounding: one forward of several rows against the pipeline's forwards of its own.
PIXEL_TOLERANCE = 1e-4
MODELS = ("tiny://z-image", "tiny://z-image-turbo")


def loaded(model: str, name: str, **spec: Any) -> Any:
    """The stage as the worker loads it; `spec`: more of the resource's spec (adapters,
    stages with their acceleration)."""
    pipeline = resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "z-image"},
                "spec": {"model": model, "pipeline": "z-image", **spec},
            }
        )
    )
    stage_spec = pipeline.stage(name)
    path = resolve_model_path(model)
    stage = stage_class(stage_spec, path)(stage_spec, path, "cpu")
    stage.load()
    return stage


def encoded(encode: Any, params: dict[str, Any]) -> dict[str, Any]:
    return {"encode": encode.run(StageJob(params, {})).tensors}


@pytest.fixture(scope="module", params=MODELS)
def split(request: pytest.FixtureRequest) -> tuple[str, list[np.ndarray]]:
    """Each request's images through the three stages, denoised in one batch."""
    model = str(request.param)
    encode, denoise, decode = (loaded(model, n) for n in ("encode", "denoise", "decode"))
    jobs = [StageJob(p, encoded(encode, p)) for p in REQUESTS]
    # Captions of three padded lengths (and CFG's negatives of two more) share the batch.
    lengths = {len(j.inputs["encode"]["prompt_embeds"]) for j in jobs}
    assert len(lengths) == 3
    assert len({denoise.batch_key(j) for j in jobs}) == 1
    results = denoise.run_batch(jobs)
    images = [
        decode.pixels(StageJob(p, {"denoise": r.tensors}))
        for p, r in zip(REQUESTS, results, strict=True)
    ]
    # The decode stage's own output: one encoded image per image asked for.
    [second] = [decode.run(StageJob(REQUESTS[1], {"denoise": results[1].tensors}))]
    assert len(second.outputs) == 2
    return model, images


def reference(model: str, params: dict[str, Any], lora: tuple[str, float] | None = None) -> Any:
    """ZImagePipeline's own images for `params`, run alone; with `lora` (an adapter's
    source and scale) loaded through its own load_lora_weights."""
    from diffusers import ZImagePipeline

    pipe: Any = ZImagePipeline.from_pretrained(resolve_model_path(model))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora[0], adapter_name="ink")
        pipe.set_adapters(["ink"], adapter_weights=[lora[1]])
    n, seed = params.get("n", 1), params.get("seed", 0)
    images = pipe(
        prompt=params["prompt"],
        negative_prompt=params.get("negative_prompt"),
        width=params["width"],
        height=params["height"],
        num_inference_steps=params["num_inference_steps"],
        guidance_scale=params["guidance_scale"],
        cfg_normalization=params.get("cfg_normalization", False),
        cfg_truncation=params.get("cfg_truncation", 1.0),
        num_images_per_prompt=n,
        generator=[torch.Generator().manual_seed(seed + i) for i in range(n)],
        output_type="np",
    ).images
    return np.asarray(images)


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_the_split_graph_equals_diffusers_one_process_pipeline(
    split: tuple[str, list[np.ndarray]], i: int
) -> None:
    model, images = split
    expected = reference(model, REQUESTS[i])
    assert images[i].shape == expected.shape == (REQUESTS[i].get("n", 1), 48, 64, 3)
    np.testing.assert_allclose(images[i], expected, rtol=0, atol=PIXEL_TOLERANCE)
    # Not a test of noise against noise: the images differ from request to request.
    others = [im[0] for j, im in enumerate(images) if j != i]
    assert all(np.abs(images[i][0] - o).max() > 0.01 for o in others)


def test_cfg_runs_above_guidance_zero_with_the_negative_prompt() -> None:
    """As ZImagePipeline decides: any guidance above 0 encodes a negative prompt (empty
    when none was sent) and changes the image; at 0 there is none, and a negative prompt
    sent is refused by name."""
    model = MODELS[0]
    encode, denoise = loaded(model, "encode"), loaded(model, "denoise")
    plain = {**BASE, "prompt": "a cat", "seed": 4}
    assert "negative_prompt_embeds" not in encoded(encode, {**plain, "guidance_scale": 0.0})
    latents = {}
    for guidance, negative in ((0.0, None), (1.0, None), (1.0, "fog")):
        params = {**plain, "guidance_scale": guidance, "negative_prompt": negative}
        inputs = encoded(encode, params)
        assert ("negative_prompt_embeds" in inputs["encode"]) is (guidance > 0)
        [result] = denoise.run_batch([StageJob(params, inputs)])
        latents[guidance, negative] = result.tensors["latents"]
    different = [(0.0, None), (1.0, None), (1.0, "fog")]
    for a, b in itertools.pairwise(different):
        assert (latents[a] - latents[b]).abs().max() > 1e-3
    with pytest.raises(StageInputError, match="negative_prompt: Z-Image uses it only") as no:
        encode.run(StageJob({**plain, "guidance_scale": 0.0, "negative_prompt": "fog"}, {}))
    assert no.value.param == "negative_prompt"


def test_requests_joining_a_running_batch_get_what_they_get_alone() -> None:
    """A request that joins between steps, of another caption length and another CFG,
    shares each forward and still gets its latents alone within 1e-4."""
    model = MODELS[0]
    encode, denoise = loaded(model, "encode"), loaded(model, "denoise")
    first, later = REQUESTS[0], REQUESTS[2]
    jobs = [StageJob(p, encoded(encode, p)) for p in (first, later)]
    alone = [denoise.run_batch([job])[0].tensors["latents"] for job in jobs]
    running = denoise.begin(jobs[0])
    denoise.step([running])
    joined = denoise.begin(jobs[1])
    while not (denoise.finished(running) and denoise.finished(joined)):
        denoise.step([s for s in (running, joined) if not denoise.finished(s)])
    for state, expected in zip((running, joined), alone, strict=True):
        got = denoise.finish(state).tensors["latents"]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_diffusers_defaults_fill_the_rest_and_the_unused_fields_are_refused_by_name() -> None:
    import inspect

    from diffusers import ZImagePipeline

    filled = EXTENSIONS.image_params({"prompt": "x"})
    call = inspect.signature(ZImagePipeline.__call__).parameters
    assert filled == {key: call[key].default for key in filled}
    assert set(filled) == {"num_inference_steps", "guidance_scale"}
    turbo = {"prompt": "x", "num_inference_steps": 8, "guidance_scale": 0}
    assert EXTENSIONS.image_params(turbo) == {}
    for name, value in (("negative_prompt", "blurry"), ("cfg_truncation", 0.5)):
        with pytest.raises(RequestProblem, match=f"{name}: .*guidance_scale above 0") as no:
            EXTENSIONS.image_params({**turbo, name: value})
        assert no.value.param == name
    options = {"cfg_normalization": True, "cfg_truncation": 0.9, "guidance_scale": 4}
    assert EXTENSIONS.image_params({"prompt": "x", **options}) == {
        "num_inference_steps": 50,
        "cfg_normalization": 1.0,
        "cfg_truncation": 0.9,
    }
    with pytest.raises(RequestProblem, match="cfg_normalization must be a number") as bad:
        EXTENSIONS.image_params({"prompt": "x", "cfg_normalization": "yes"})
    assert bad.value.param == "cfg_normalization"
    with pytest.raises(RequestProblem, match="/v1/images/generations"):
        EXTENSIONS.chat_image_params({"prompt": "x"}, lambda s: (64, 64))


def test_a_wrong_parameter_type_is_the_clients_error() -> None:
    encode = loaded(MODELS[0], "encode")
    with pytest.raises(StageInputError, match="prompt must be a non-empty string"):
        encode.run(StageJob({"prompt": ""}, {}))


LORA = {**BASE, "prompt": "a lighthouse at dusk", "guidance_scale": 3.0, "seed": 5}


def test_a_lora_adapter_is_applied_as_diffusers_applies_it() -> None:
    """spec.adapters on the denoiser: a request naming the adapter at a scale gets the
    image ZImagePipeline makes with load_lora_weights and that scale (the adapter's alpha
    is not its rank: its strength comes from its saved config, as in diffusers); the base
    model is there still, and other adapters or scales never share a batch."""
    model = MODELS[0]
    source = str(resolve_model_path("tiny://z-image-lora"))
    adapters = [{"name": "ink", "source": source, "stage": "denoise"}]
    encode, decode = loaded(model, "encode"), loaded(model, "decode")
    denoise = loaded(model, "denoise", adapters=adapters)
    inputs = encoded(encode, LORA)
    lora = {**LORA, "lora": {"name": "ink", "scale": 0.7}}
    [with_lora] = denoise.run_batch([StageJob(lora, inputs)])
    [base] = denoise.run_batch([StageJob(LORA, inputs)])
    images = decode.pixels(StageJob(LORA, {"denoise": with_lora.tensors}))
    expected = reference(model, LORA, lora=(source, 0.7))
    np.testing.assert_allclose(images, expected, rtol=0, atol=PIXEL_TOLERANCE)
    plain = decode.pixels(StageJob(LORA, {"denoise": base.tensors}))
    assert np.abs(plain - images).max() > 0.01  # the adapter changed the image
    np.testing.assert_allclose(plain, reference(model, LORA), rtol=0, atol=PIXEL_TOLERANCE)
    keys = {
        denoise.batch_key(StageJob(p, inputs))
        for p in (LORA, lora, {**lora, "lora": {"name": "ink", "scale": 1.0}})
    }
    assert len(keys) == 3
    with pytest.raises(StageInputError, match=r"lora\.name: this stage has no adapter 'neon'"):
        denoise.begin(StageJob({**LORA, "lora": {"name": "neon", "scale": 1.0}}, inputs))


def test_int8_weights_stay_near_full_precision() -> None:
    from torchao.utils import TorchAOBaseTensor

    model = MODELS[0]
    job = StageJob(LORA, encoded(loaded(model, "encode"), LORA))
    [full] = loaded(model, "denoise").run_batch([job])
    stages = [{"name": "denoise", "acceleration": {"quantization": {"method": "int8-weight-only"}}}]
    quantized = loaded(model, "denoise", stages=stages)
    linears = [m for m in quantized.pipe.transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    assert all(isinstance(m.weight, TorchAOBaseTensor) for m in linears)
    [got] = quantized.run_batch([job])
    a, b = full.tensors["latents"], got.tensors["latents"]
    error = float((b - a).norm() / a.norm())
    assert 0 < error < 0.01, f"relative error {error:.4f}"


@pytest.mark.parametrize("model", MODELS)
def test_a_z_image_checkpoint_is_served_as_a_z_image_pipeline(model: str) -> None:
    """The released checkpoints say ZImagePipeline in model_index.json, as the tiny ones
    do: `omnipipe serve MODEL` reads it and picks the z-image type, not the catch-all."""
    from omnipipe.api.from_model import checkpoint_descriptors, manifest_for_model

    said = checkpoint_descriptors(resolve_model_path(model))
    assert said == {"model_index.json": "ZImagePipeline"}
    assert manifest_for_model(model, said).spec.pipeline == "z-image"
