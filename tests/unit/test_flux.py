"""tiny://flux1-dev and tiny://flux1-schnell split into three stages equal diffusers'
one-process FluxPipeline: the same pixels, within float rounding of another batch shape,
for requests denoised in one batch with their own seeds, step counts, guidance and image
counts; a LoRA adapter as diffusers' own loading applies it, int8 weights near full precision;
and the request fields FLUX does not take are refused by name."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.api import parse_resource, resolve
from omnipipe.api.families import RequestProblem
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.flux.requests import EXTENSIONS
from omnipipe.stagekit.stage import StageInputError, StageJob
from omnipipe.worker.stage_classes import stage_class

pytestmark = pytest.mark.timeout(600)
BASE = {"width": 64, "height": 48, "num_inference_steps": 4}
REQUESTS = [
    {**BASE, "prompt": "a lighthouse at dusk", "guidance_scale": 3.5, "seed": 1},
    {**BASE, "prompt": "a cat", "guidance_scale": 7.0, "seed": 2, "n": 2},
    {**BASE, "prompt": "a dog on a beach", "guidance_scale": 1.0, "num_inference_steps": 3},
]
# Float rounding: one forward of several rows against the pipeline's forwards of one.
PIXEL_TOLERANCE = 1e-4
MODELS = ("tiny://flux1-dev", "tiny://flux1-schnell")


def loaded(model: str, name: str, **spec: Any) -> Any:
    """The stage as the worker loads it; `spec`: more of the resource's spec (adapters,
    stages with their acceleration)."""
    pipeline = resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "flux"},
                "spec": {"model": model, "pipeline": "flux", **spec},
            }
        )
    )
    stage_spec = pipeline.stage(name)
    path = resolve_model_path(model)
    stage = stage_class(stage_spec, path)(stage_spec, path, "cpu")
    stage.load()
    return stage


@pytest.fixture(scope="module", params=MODELS)
def split(request: pytest.FixtureRequest) -> tuple[str, list[np.ndarray]]:
    """Each request's images through the three stages, denoised in one batch."""
    model = str(request.param)
    encode, denoise, decode = (loaded(model, n) for n in ("encode", "denoise", "decode"))
    jobs = [StageJob(p, {"encode": encode.run(StageJob(p, {})).tensors}) for p in REQUESTS]
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


def reference(
    model: str, params: dict[str, Any], lora: tuple[str, float] | None = None, **more: Any
) -> np.ndarray:
    """The checkpoint's own pipeline's images for `params` (FluxPipeline's, or
    FluxKontextPipeline's given `more`: its image and max_area); with `lora` (an
    adapter's source and scale) loaded through its own load_lora_weights."""
    from diffusers import DiffusionPipeline

    pipe: Any = DiffusionPipeline.from_pretrained(resolve_model_path(model))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora[0], adapter_name="ink")
        pipe.set_adapters(["ink"], adapter_weights=[lora[1]])
    n, seed = params.get("n", 1), params.get("seed", 0)
    images = pipe(
        prompt=params["prompt"],
        width=params["width"],
        height=params["height"],
        num_inference_steps=params["num_inference_steps"],
        guidance_scale=params["guidance_scale"],
        num_images_per_prompt=n,
        generator=[torch.Generator().manual_seed(seed + i) for i in range(n)],
        output_type="np",
        **more,
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


def test_dev_takes_its_guidance_and_schnell_has_none() -> None:
    """dev's distilled guidance is the model's input (another scale, other latents);
    schnell's transformer has no guidance input, as released: the scale changes nothing."""
    for model, guided in zip(MODELS, (True, False), strict=True):
        encode, denoise = loaded(model, "encode"), loaded(model, "denoise")
        assert denoise.guidance_embeds is guided
        inputs = {"encode": encode.run(StageJob(REQUESTS[0], {})).tensors}
        low, high = (
            denoise.run_batch([StageJob({**REQUESTS[0], "guidance_scale": g}, inputs)])[0]
            for g in (1.0, 7.0)
        )
        same = torch.equal(low.tensors["latents"], high.tensors["latents"])
        assert same is not guided, model


def test_a_negative_prompt_is_refused_by_name_and_diffusers_defaults_fill_the_rest() -> None:
    with pytest.raises(RequestProblem, match="takes no negative prompt") as refused:
        EXTENSIONS.image_params({"prompt": "x", "negative_prompt": "blurry"})
    assert refused.value.param == "negative_prompt"
    assert EXTENSIONS.image_params({"prompt": "x"}) == {
        "num_inference_steps": 28,
        "guidance_scale": 3.5,
    }
    assert (
        EXTENSIONS.image_params({"prompt": "x", "num_inference_steps": 4, "guidance_scale": 0})
        == {}
    )
    with pytest.raises(RequestProblem, match="/v1/images/generations"):
        EXTENSIONS.chat_image_params({"prompt": "x"}, lambda s: (64, 64))


def test_a_wrong_parameter_type_is_the_clients_error() -> None:
    encode = loaded(MODELS[0], "encode")
    with pytest.raises(StageInputError, match="prompt must be a non-empty string"):
        encode.run(StageJob({"prompt": ""}, {}))


LORA = {**BASE, "prompt": "a lighthouse at dusk", "guidance_scale": 3.5, "seed": 5}


def test_a_lora_adapter_is_applied_as_diffusers_applies_it() -> None:
    """spec.adapters on the denoiser: a request naming the adapter at a scale gets the
    image FluxPipeline makes with load_lora_weights and that scale (the adapter's alpha is
    not its rank: its strength comes from its saved config, as in diffusers); the base
    model is there still, and other adapters or scales never share a batch."""

    model = MODELS[0]
    source = str(resolve_model_path("tiny://flux1-dev-lora"))
    adapters = [{"name": "ink", "source": source, "stage": "denoise"}]
    encode, decode = loaded(model, "encode"), loaded(model, "decode")
    denoise = loaded(model, "denoise", adapters=adapters)
    inputs = {"encode": encode.run(StageJob(LORA, {})).tensors}
    lora = {**LORA, "lora": {"name": "ink", "scale": 0.7}}
    [with_lora, base] = denoise.run_batch([StageJob(lora, inputs)]) + denoise.run_batch(
        [StageJob(LORA, inputs)]
    )
    images = decode.pixels(StageJob(LORA, {"denoise": with_lora.tensors}))
    expected = reference(model, LORA, lora=(source, 0.7))
    np.testing.assert_allclose(images, expected, rtol=0, atol=PIXEL_TOLERANCE)
    plain = decode.pixels(StageJob(LORA, {"denoise": base.tensors}))
    assert np.abs(plain - images).max() > 0.01  # the adapter changed the image
    # And a request naming none gets the base model, the adapter loaded beside it.
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
    encode = loaded(model, "encode")
    job = StageJob(LORA, {"encode": encode.run(StageJob(LORA, {})).tensors})
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


def test_the_step_cache_is_refused_by_name() -> None:
    stages = [{"name": "denoise", "acceleration": {"cache": {}}}]
    with pytest.raises(NotImplementedError, match=r"does not support acceleration\.cache"):
        loaded(MODELS[0], "denoise", stages=stages)
