"""The diffusers fallback (`pipeline: diffusers`) on two pipelines no family splits,
Stable Diffusion 3 and Sana: requests run in one call of the pipeline equal the
pipeline's own images for each alone; a client's unset steps and guidance keep the
pipeline's defaults; each step is reported and a call whose requests are all cancelled
stops; a checkpoint no type claims resolves to the fallback, and a spec that names it
runs it on any diffusers checkpoint; a pipeline that does not make images is refused by
what it makes."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.api.from_model import checkpoint_descriptors, manifest_for_model
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.diffusers_any.classes import refusal, type_for_class
from omnipipe.families.diffusers_any.requests import EXTENSIONS
from omnipipe.families.diffusers_any.stage import WholePipelineStage
from omnipipe.stagekit.stage import StageInputError, StageJob
from omnipipe.worker.stage_classes import stage_class
from tests.harness.fallback import cancelled_at_first_step, fallback_spec, fallback_stage
from tests.harness.usage import expected_usage

pytestmark = pytest.mark.timeout(600)
BASE = {"width": 64, "height": 96, "num_inference_steps": 3, "guidance_scale": 5.0}
REQUESTS = [
    {**BASE, "prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "seed": 1},
    {**BASE, "prompt": "a cat", "negative_prompt": "a dog", "seed": 7, "n": 2},
]
# Float rounding: one call of several rows against the pipeline's calls of one.
PIXEL_TOLERANCE = 1e-4
MODELS = ("tiny://sd3", "tiny://sana")


def loaded(model: str) -> WholePipelineStage:
    stage = fallback_stage(model, "diffusers", WholePipelineStage)
    stage.load()
    return stage


def spec_of(model: str) -> Any:
    return fallback_spec(model, "diffusers")


def reference(stage: WholePipelineStage, params: dict[str, Any]) -> np.ndarray:
    """The pipeline's own images for one request alone."""
    n = int(params.get("n", 1))
    with torch.inference_mode():
        return np.asarray(
            stage.pipe(
                prompt=params["prompt"],
                negative_prompt=params["negative_prompt"],
                width=params["width"],
                height=params["height"],
                num_inference_steps=params["num_inference_steps"],
                guidance_scale=params["guidance_scale"],
                num_images_per_prompt=n,
                generator=[torch.Generator().manual_seed(params["seed"] + i) for i in range(n)],
                output_type="np",
            ).images
        )


@pytest.fixture(scope="module", params=MODELS)
def stage(request: pytest.FixtureRequest) -> WholePipelineStage:
    return loaded(str(request.param))


def test_requests_in_one_call_equal_the_pipeline_for_each_alone(
    stage: WholePipelineStage,
) -> None:
    jobs = [StageJob(dict(p), {}) for p in REQUESTS]
    assert len({stage.batch_key(j) for j in jobs}) == 1
    made = stage.images(jobs, "np")
    for params, images in zip(REQUESTS, made, strict=True):
        assert images is not None
        ours = np.stack(images)
        alone = reference(stage, params)
        assert ours.shape == alone.shape == (params.get("n", 1), 96, 64, 3)
        assert np.abs(ours - alone).max() <= PIXEL_TOLERANCE
    # Not the same picture twice: the seeds and prompts reach their rows.
    first, second = made
    assert first is not None
    assert second is not None
    assert np.abs(first[0] - second[0]).max() > 0.01
    assert np.abs(second[0] - second[1]).max() > 0.01


def latent_tokens(stage: WholePipelineStage, params: dict[str, Any]) -> int:
    """The tokens the pipeline's DiT attends to for one of the request's images: its
    own latents for the request (output_type "latent"), in the DiT's patches."""
    call = {k: params[k] for k in ("prompt", "width", "height", "num_inference_steps")}
    with torch.inference_mode():
        latents = stage.pipe(**call, output_type="latent").images
    patch = stage.pipe.transformer.config.patch_size
    return int(latents.shape[-2] // patch * (latents.shape[-1] // patch))


def test_the_served_result_is_the_requested_format_with_its_usage(
    stage: WholePipelineStage,
) -> None:
    params = {**REQUESTS[1], "output_format": "webp"}
    [result] = stage.run_batch([StageJob(params, {})])
    assert len(result.outputs) == 2
    assert base64.b64decode(result.outputs[0]["b64_json"])[8:12] == b"WEBP"
    # The prompt and, under CFG, the negative prompt; each of the two images' latents.
    text = text_tokens(stage.model_path, ["a cat", "a dog"])
    assert result.usage == {"text_tokens": text, "output_tokens": 2 * latent_tokens(stage, params)}
    assert text > 0
    assert result.usage["output_tokens"] > 0
    unguided = {**params, "guidance_scale": 1.0}
    [result] = stage.run_batch([StageJob(unguided, {})])
    assert (
        result.usage["text_tokens"]
        == expected_usage(stage.model_path, ["a cat"], 0)["input_tokens"]
    )


def test_what_a_call_shares_is_its_key(stage: WholePipelineStage) -> None:
    key = stage.batch_key(StageJob(dict(REQUESTS[0]), {}))
    for change in (
        {"width": 128},
        {"num_inference_steps": 4},
        {"guidance_scale": 3.0},
        {"negative_prompt": None},
    ):
        assert stage.batch_key(StageJob({**REQUESTS[0], **change}, {})) != key
    # The prompt, the seed and the count do not part requests.
    same = {**REQUESTS[0], "prompt": "other", "seed": 99, "n": 3}
    assert stage.batch_key(StageJob(same, {})) == key


def test_unset_settings_keep_the_pipelines_defaults_and_each_step_is_reported() -> None:
    """The router's image API defaults (50 steps at guidance 4) are not the pipeline's:
    the fallback's request extensions leave what the client did not set to it."""
    assert EXTENSIONS.image_params({"prompt": "x"}) == {
        "num_inference_steps": None,
        "guidance_scale": None,
    }
    assert EXTENSIONS.image_params({"num_inference_steps": 4, "guidance_scale": 2.0}) == {}
    stage = loaded("tiny://sd3")
    params = {"prompt": "a cat", "width": 32, "height": 32, "seed": 0}
    params.update(EXTENSIONS.image_params(params))
    steps: list[tuple[int, int]] = []
    job = StageJob(params, {})
    job.on_step = lambda step, total: steps.append((step, total))
    stage.images([job], "np")
    # StableDiffusion3Pipeline's own default: 28 steps.
    assert steps == [(i, 28) for i in range(1, 29)]


def test_a_call_whose_requests_are_all_cancelled_stops() -> None:
    stage = loaded("tiny://sd3")
    params = {**REQUESTS[0], "num_inference_steps": 20, "width": 32, "height": 32}
    result, steps = cancelled_at_first_step(stage, params)
    assert result.outputs == []
    assert steps == [(1, 20)]  # the other 19 were skipped


def test_a_checkpoint_no_type_claims_is_served_by_the_fallback() -> None:
    for model in MODELS:
        said = checkpoint_descriptors(resolve_model_path(model))
        assert manifest_for_model(model, said).spec.pipeline == "diffusers"
    # A checkpoint a family claims keeps its family, unless the spec names the fallback.
    flux = resolve_model_path("tiny://flux1-dev")
    assert manifest_for_model("tiny://flux1-dev", checkpoint_descriptors(flux)).spec.pipeline == (
        "flux"
    )
    spec = spec_of("tiny://flux1-dev")
    assert stage_class(spec, flux, "diffusers") is WholePipelineStage
    assert stage_class(spec, flux, "flux") is not WholePipelineStage


def test_a_pipeline_that_makes_no_images_is_refused_naming_the_type_that_serves_it() -> None:
    spec, path = spec_of("tiny://wan"), resolve_model_path("tiny://wan")
    stage = stage_class(spec, path, "diffusers")(spec, path, "cpu")
    with pytest.raises(
        NotImplementedError,
        match=r"WanPipeline makes videos: serve it as pipeline diffusers-video, not diffusers",
    ):
        stage.load()


def test_what_a_class_makes_picks_the_fallback_type_of_a_model_named_alone() -> None:
    """`omnipipe serve MODEL` on a checkpoint no family claims: its class's output decides
    the endpoint; an unknown class falls to `diffusers`, whose stage refuses it by name."""
    assert type_for_class("StableDiffusion3Pipeline") == "diffusers"
    assert type_for_class("SanaPipeline") == "diffusers"
    assert type_for_class("StableDiffusion3InpaintPipeline") == "diffusers-edit"
    assert type_for_class("FluxImg2ImgPipeline") == "diffusers-edit"
    assert type_for_class("CogVideoXPipeline") == "diffusers-video"
    assert type_for_class("LTXPipeline") == "diffusers-video"
    assert type_for_class("AudioLDMPipeline") == "diffusers-audio"
    assert type_for_class("StableAudioPipeline") == "diffusers-audio"
    assert type_for_class("NoSuchPipeline") == "diffusers"


def test_what_the_fallback_cannot_serve_is_refused_by_its_class() -> None:
    from diffusers import (
        FluxInpaintPipeline,
        StableDiffusion3Img2ImgPipeline,
        StableDiffusion3Pipeline,
        StableDiffusionXLControlNetPipeline,
    )

    assert refusal(StableDiffusion3Pipeline, "diffusers") is None
    # A ControlNet pipeline's image is its control, not the image an edit changes.
    for serves in ("diffusers", "diffusers-edit"):
        assert "takes a control image" in str(refusal(StableDiffusionXLControlNetPipeline, serves))
    for needs_image in (StableDiffusion3Img2ImgPipeline, FluxInpaintPipeline):
        assert f"{needs_image.__name__} edits images: serve it as pipeline diffusers-edit" in str(
            refusal(needs_image, "diffusers")
        )
    assert "serve it as pipeline diffusers, not diffusers-video" in str(
        refusal(StableDiffusion3Pipeline, "diffusers-video")
    )
    # /v1/videos and /v1/audio/generate take text alone: an image-to-video pipeline
    # would load, then fail every job for want of its `image`.
    from diffusers import CogVideoXImageToVideoPipeline, CogVideoXVideoToVideoPipeline

    for needs_media in (CogVideoXImageToVideoPipeline, CogVideoXVideoToVideoPipeline):
        assert f"{needs_media.__name__} needs an input image, video or clip" in str(
            refusal(needs_media, "diffusers-video")
        )


def test_a_request_the_pipeline_refuses_is_the_clients_error() -> None:
    """diffusers' own input checks (SD3's sides must be multiples of 16) are a 400, named
    as the pipeline names them, not a failure of the stage."""
    stage = loaded("tiny://sd3")
    job = StageJob({**REQUESTS[0], "width": 40, "height": 40}, {})
    with pytest.raises(StageInputError, match="divisible by 16"):
        stage.images([job], "np")


def test_a_true_cfg_pipeline_takes_the_guidance_as_its_true_cfg_scale() -> None:
    """FLUX.1 run whole: with a negative prompt the request's guidance is FluxPipeline's
    true_cfg_scale (its guidance_scale is the distilled one), as the image API means it."""
    stage = loaded("tiny://flux1-dev")
    negative = StageJob(dict(REQUESTS[0]), {})
    assert stage._call_arguments(negative, negative=True)["true_cfg_scale"] == 5.0
    plain = StageJob({**REQUESTS[0], "negative_prompt": None}, {})
    arguments = stage._call_arguments(plain, negative=False)
    assert "true_cfg_scale" not in arguments
    assert arguments["guidance_scale"] == 5.0
    # The usage counts the negative prompt only where the call ran true CFG: not at
    # FluxPipeline's own true_cfg_scale, 1.0, when the request sends no guidance.
    prompt, negative_prompt = str(REQUESTS[0]["prompt"]), str(REQUESTS[0]["negative_prompt"])
    unguided = StageJob({**REQUESTS[0], "guidance_scale": None}, {})
    [result] = stage.run_batch([unguided])
    assert result.usage["text_tokens"] == text_tokens("tiny://flux1-dev", [prompt])
    [result] = stage.run_batch([negative])
    both = text_tokens("tiny://flux1-dev", [prompt, negative_prompt])
    assert result.usage["text_tokens"] == both > text_tokens("tiny://flux1-dev", [prompt])


def text_tokens(model: str, texts: list[str]) -> int:
    counted = expected_usage(model, texts, 0)["input_tokens"]
    assert isinstance(counted, int)
    return counted
