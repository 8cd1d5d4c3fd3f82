"""tiny://flux2-dev, tiny://flux2-klein-base and tiny://flux2-klein split into three
stages equal diffusers' one-process Flux2Pipeline and Flux2KleinPipeline: the same
pixels, within float rounding of another batch shape, for requests denoised in one batch
with their own seeds, step counts, guidance, negative prompts and image counts (klein's
CFG rows beside rows without); a request's latents do not depend on what shares its
batch; a LoRA adapter as diffusers' own loading applies it, int8 weights near full
precision; and what FLUX.2 does not take is refused by name."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.api import parse_resource, resolve
from omnipipe.api.families import RequestProblem, family_for_checkpoint
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.flux2.requests import EXTENSIONS
from omnipipe.stagekit.stage import StageInputError, StageJob
from omnipipe.worker.stage_classes import stage_class

pytestmark = pytest.mark.timeout(600)
BASE = {"width": 64, "height": 48, "num_inference_steps": 3}
DEV, KLEIN_BASE, KLEIN = "tiny://flux2-dev", "tiny://flux2-klein-base", "tiny://flux2-klein"
PIPELINE = {DEV: "flux2", KLEIN_BASE: "flux2-klein", KLEIN: "flux2-klein"}
REQUESTS = {
    DEV: [
        {**BASE, "prompt": "a lighthouse at dusk", "guidance_scale": 4.0, "seed": 1},
        {
            **BASE,
            "prompt": "a cat",
            "guidance_scale": 7.0,
            "seed": 2,
            "n": 2,
            "num_inference_steps": 2,
        },
    ],
    KLEIN_BASE: [
        {**BASE, "prompt": "a boat", "guidance_scale": 4.0, "seed": 1, "negative_prompt": "fog"},
        {**BASE, "prompt": "a cat", "guidance_scale": 1.0, "seed": 2, "n": 2},
        {**BASE, "prompt": "a dog", "guidance_scale": 2.5, "num_inference_steps": 2},
    ],
    KLEIN: [{**BASE, "prompt": "a cat", "guidance_scale": 4.0, "seed": 3}],
}
# Float rounding: one forward of several rows against the pipeline's forwards of one.
PIXEL_TOLERANCE = 1e-4


def loaded(model: str, name: str, **spec: Any) -> Any:
    """The stage as the worker loads it; `spec`: more of the resource's spec (adapters,
    stages with their acceleration)."""
    pipeline = resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "flux2"},
                "spec": {"model": model, "pipeline": PIPELINE[model], **spec},
            }
        )
    )
    stage_spec = pipeline.stage(name)
    path = resolve_model_path(model)
    stage = stage_class(stage_spec, path)(stage_spec, path, "cpu")
    stage.load()
    return stage


@functools.cache
def stage_of(model: str, name: str) -> Any:
    """The stage loaded with nothing more in its spec, once per test session."""
    return loaded(model, name)


@functools.cache
def one_process(model: str) -> Any:
    from diffusers import DiffusionPipeline

    pipe: Any = DiffusionPipeline.from_pretrained(resolve_model_path(model))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(
    model: str, params: dict[str, Any], lora: tuple[str, float] | None = None
) -> np.ndarray:
    """The checkpoint's own pipeline's images for `params`; a negative prompt given as
    the pipeline takes one (its embeddings: its own would be ""); with `lora` (an
    adapter's source and scale) loaded through its own load_lora_weights."""
    from diffusers import DiffusionPipeline

    pipe: Any = one_process(model)
    if lora is not None:
        pipe = DiffusionPipeline.from_pretrained(resolve_model_path(model))
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(lora[0], adapter_name="ink")
        pipe.set_adapters(["ink"], adapter_weights=[lora[1]])
    return pipeline_images(pipe, params)


def pipeline_images(pipe: Any, params: dict[str, Any], **more: Any) -> np.ndarray:
    """`pipe`'s images for the request `params` (and `more` of its call's arguments), each
    row its own seed; a negative prompt given as the pipeline takes one (its embeddings:
    its own would be "")."""
    if params.get("negative_prompt"):
        more["negative_prompt_embeds"] = pipe.encode_prompt(params["negative_prompt"])[0]
    n, seed = params.get("n", 1), params.get("seed", 0)
    images = pipe(
        prompt=params["prompt"],
        width=params["width"],
        height=params["height"],
        num_inference_steps=params["num_inference_steps"],
        guidance_scale=params.get("guidance_scale", 4.0),
        num_images_per_prompt=n,
        generator=[torch.Generator().manual_seed(seed + i) for i in range(n)],
        output_type="np",
        **more,
    ).images
    return np.asarray(images)


def encoded(encode: Any, params: dict[str, Any]) -> dict[str, Any]:
    return {"encode": encode.run(StageJob(params, {})).tensors}


@pytest.mark.parametrize("model", [DEV, KLEIN_BASE, KLEIN])
def test_the_split_graph_equals_diffusers_one_process_pipeline(model: str) -> None:
    """Each request's images through the three stages, denoised in one batch, equal the
    pipeline's for that request alone; and each request's latents alone equal its
    latents in the batch."""
    requests = REQUESTS[model]
    encode, denoise, decode = (stage_of(model, n) for n in ("encode", "denoise", "decode"))
    jobs = [StageJob(p, encoded(encode, p)) for p in requests]
    assert len({denoise.batch_key(j) for j in jobs}) == 1
    results = denoise.run_batch(jobs)
    images = []
    for params, result in zip(requests, results, strict=True):
        got = decode.pixels(StageJob(params, {"denoise": result.tensors}))
        expected = reference(model, params)
        assert got.shape == expected.shape == (params.get("n", 1), 48, 64, 3)
        np.testing.assert_allclose(got, expected, rtol=0, atol=PIXEL_TOLERANCE)
        images.append(got[0])
    # The last request alone: its latents are the batch's (under klein-base, a CFG
    # request whose batch had rows without CFG).
    [alone] = denoise.run_batch(jobs[-1:])
    torch.testing.assert_close(
        alone.tensors["latents"], results[-1].tensors["latents"], rtol=0, atol=1e-5
    )
    # Not a test of noise against noise: the images differ from request to request.
    assert all(np.abs(a - b).max() > 0.01 for a in images for b in images if a is not b)
    # The decode stage's own output: one encoded image per image asked for.
    if len(requests) > 1:
        second = decode.run(StageJob(requests[1], {"denoise": results[1].tensors}))
        assert len(second.outputs) == 2


def latents_at(model: str, params: dict[str, Any], guidance: float) -> torch.Tensor:
    encode, denoise = stage_of(model, "encode"), stage_of(model, "denoise")
    params = {**params, "guidance_scale": guidance}
    [result] = denoise.run_batch([StageJob(params, encoded(encode, params))])
    return result.tensors["latents"]


def test_guidance_is_dev_input_klein_base_cfg_and_nothing_to_distilled_klein() -> None:
    """dev's guidance is the model's input and klein-base's scales its CFG: another scale,
    other latents. The step-distilled klein runs no CFG and has no guidance input: the
    scale changes nothing, as in Flux2KleinPipeline."""
    params = REQUESTS[KLEIN][0]
    for model, guided in ((DEV, True), (KLEIN_BASE, True), (KLEIN, False)):
        same = torch.equal(latents_at(model, params, 2.0), latents_at(model, params, 7.0))
        assert same is not guided, model


@pytest.mark.parametrize(
    ("model", "words"),
    [(DEV, "FLUX.2 dev takes no negative prompt"), (KLEIN, "step-distilled and runs no CFG")],
)
def test_a_negative_prompt_is_refused_by_name_where_there_is_no_cfg(model: str, words: str) -> None:
    encode = stage_of(model, "encode")
    with pytest.raises(StageInputError, match=words) as refused:
        encode.run(StageJob({**BASE, "prompt": "x", "negative_prompt": "blurry"}, {}))
    assert refused.value.param == "negative_prompt"
    with pytest.raises(StageInputError, match="prompt must be a non-empty string"):
        encode.run(StageJob({"prompt": ""}, {}))


def test_diffusers_defaults_fill_what_the_client_left_out() -> None:
    import inspect

    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    filled = EXTENSIONS.image_params({"prompt": "x"})
    for pipeline_class in (Flux2Pipeline, Flux2KleinPipeline):
        call = inspect.signature(pipeline_class.__call__).parameters
        assert filled == {key: call[key].default for key in filled}
    assert set(filled) == {"num_inference_steps", "guidance_scale"}
    sent = {"prompt": "x", "num_inference_steps": 4, "guidance_scale": 1}
    assert EXTENSIONS.image_params(sent) == {}
    with pytest.raises(RequestProblem, match="/v1/images/generations"):
        EXTENSIONS.chat_image_params({"prompt": "x"}, lambda s: (64, 64))


LORA = {**BASE, "prompt": "a lighthouse at dusk", "guidance_scale": 4.0, "seed": 5}


def test_a_lora_adapter_is_applied_as_diffusers_applies_it() -> None:
    """spec.adapters on the denoiser: a request naming the adapter at a scale gets the
    image Flux2Pipeline makes with load_lora_weights and that scale (the adapter's alpha
    is not its rank: its strength comes from its saved config, as in diffusers), its
    double- and single-stream layers alike; the base model is there still, and other
    adapters or scales never share a batch."""
    source = str(resolve_model_path("tiny://flux2-dev-lora"))
    adapters = [{"name": "ink", "source": source, "stage": "denoise"}]
    encode, decode = stage_of(DEV, "encode"), stage_of(DEV, "decode")
    denoise = loaded(DEV, "denoise", adapters=adapters)
    inputs = encoded(encode, LORA)
    lora = {**LORA, "lora": {"name": "ink", "scale": 0.7}}
    [with_lora] = denoise.run_batch([StageJob(lora, inputs)])
    [base] = denoise.run_batch([StageJob(LORA, inputs)])
    images = decode.pixels(StageJob(LORA, {"denoise": with_lora.tensors}))
    expected = reference(DEV, LORA, lora=(source, 0.7))
    np.testing.assert_allclose(images, expected, rtol=0, atol=PIXEL_TOLERANCE)
    plain = decode.pixels(StageJob(LORA, {"denoise": base.tensors}))
    assert np.abs(plain - images).max() > 0.01  # the adapter changed the image
    np.testing.assert_allclose(plain, reference(DEV, LORA), rtol=0, atol=PIXEL_TOLERANCE)
    keys = {
        denoise.batch_key(StageJob(p, inputs))
        for p in (LORA, lora, {**lora, "lora": {"name": "ink", "scale": 1.0}})
    }
    assert len(keys) == 3
    with pytest.raises(StageInputError, match=r"lora\.name: this stage has no adapter 'neon'"):
        denoise.begin(StageJob({**LORA, "lora": {"name": "neon", "scale": 1.0}}, inputs))


def test_int8_weights_stay_near_full_precision() -> None:
    from torchao.utils import TorchAOBaseTensor

    job = StageJob(LORA, encoded(stage_of(DEV, "encode"), LORA))
    [full] = stage_of(DEV, "denoise").run_batch([job])
    stages = [{"name": "denoise", "acceleration": {"quantization": {"method": "int8-weight-only"}}}]
    quantized = loaded(DEV, "denoise", stages=stages)
    linears = [m for m in quantized.pipe.transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    assert all(isinstance(m.weight, TorchAOBaseTensor) for m in linears)
    [got] = quantized.run_batch([job])
    a, b = full.tensors["latents"], got.tensors["latents"]
    error = float((b - a).norm() / a.norm())
    assert 0 < error < 0.01, f"relative error {error:.4f}"


def test_the_step_cache_is_refused_by_name() -> None:
    stages = [{"name": "denoise", "acceleration": {"cache": {}}}]
    for model in (DEV, KLEIN_BASE):
        with pytest.raises(NotImplementedError, match=r"does not support acceleration\.cache"):
            loaded(model, "denoise", stages=stages)


def test_the_released_checkpoints_resolve_to_their_pipeline_types() -> None:
    """By model_index.json's `_class_name`, as `omnipipe serve MODEL` reads it."""
    for marker, pipeline in (("Flux2Pipeline", "flux2"), ("Flux2KleinPipeline", "flux2-klein")):
        found = family_for_checkpoint([marker])
        assert found is not None
        assert (found[0].name, found[1].name) == ("flux2", pipeline)
