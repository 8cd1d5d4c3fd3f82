"""The diffusers fallback's video type (`pipeline: diffusers-video`) on CogVideoX, a
text-to-video pipeline no family splits: jobs run in one call of the pipeline get the
frames CogVideoXPipeline makes for each alone, as an MP4 at the job's rate; a job's unset
steps and guidance keep the pipeline's defaults; each step is reported; a call whose
jobs are all cancelled ends before it decodes, and a cancelled job leaves the others of
its call their videos; /v1/videos requests are checked with the field named, and the
checkpoint is served as a video pipeline when named alone."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import torch

from omnipipe.api.families import RequestProblem
from omnipipe.api.from_model import checkpoint_descriptors, manifest_for_model
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.diffusers_any.stage import WholePipelineStage
from omnipipe.families.diffusers_any.tiny import VOCAB
from omnipipe.families.diffusers_any.video import WholeVideoStage
from omnipipe.families.diffusers_any.video_requests import EXTENSIONS
from omnipipe.stagekit.stage import StageJob
from omnipipe.stagekit.tiny_vae import tiny_image_vae
from omnipipe.stagekit.tokenizer import save_byte_tokenizer
from omnipipe.worker.stage_classes import stage_class
from tests.harness.fallback import cancelled_at_first_step, fallback_spec, fallback_stage

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny://cogvideox"
# 9 frames: 3 latent frames, decoded to 9.
BASE = {"width": 64, "height": 48, "num_frames": 9, "num_inference_steps": 3, "fps": 8}
JOBS = [
    {
        **BASE,
        "guidance_scale": 5.0,
        "prompt": "a lighthouse",
        "negative_prompt": "blurry",
        "seed": 1,
    },
    {**BASE, "guidance_scale": 5.0, "prompt": "a cat", "negative_prompt": "a dog", "seed": 7},
]
# Float rounding: one call of several rows against the pipeline's calls of one.
PIXEL_TOLERANCE = 1e-4


def spec_of(pipeline: str, model: str = MODEL) -> Any:
    return fallback_spec(model, pipeline)


def loaded(model: str) -> WholeVideoStage:
    made = fallback_stage(model, "diffusers-video", WholeVideoStage)
    made.load()
    return made


@pytest.fixture(scope="module")
def stage() -> WholeVideoStage:
    return loaded(MODEL)


@pytest.fixture(scope="module")
def pipe() -> Any:
    """CogVideoXPipeline itself, loaded apart from the stage."""
    from diffusers import CogVideoXPipeline

    loaded: Any = CogVideoXPipeline.from_pretrained(resolve_model_path(MODEL))
    loaded.set_progress_bar_config(disable=True)
    return loaded


def alone(pipe: Any, params: dict[str, Any]) -> np.ndarray:
    """The pipeline's own frames for one job, with the settings the job sets."""
    keys = ("width", "height", "num_frames", "num_inference_steps", "guidance_scale")
    call = {key: params[key] for key in keys if params.get(key) is not None}
    if params.get("negative_prompt"):
        call["negative_prompt"] = params["negative_prompt"]
    with torch.inference_mode():
        frames = pipe(
            prompt=params["prompt"],
            generator=torch.Generator().manual_seed(params["seed"]),
            output_type="np",
            **call,
        ).frames
    return np.asarray(frames[0])


@pytest.fixture(scope="module")
def theirs(pipe: Any) -> list[np.ndarray]:
    """The pipeline's own frames for each of JOBS alone."""
    return [alone(pipe, params) for params in JOBS]


def test_jobs_in_one_call_equal_the_pipeline_for_each_alone(
    stage: WholeVideoStage, theirs: list[np.ndarray]
) -> None:
    jobs = [StageJob(dict(p), {}) for p in JOBS]
    assert len({stage.batch_key(j) for j in jobs}) == 1
    made = stage.videos(jobs)
    for ours, alone_ in zip(made, theirs, strict=True):
        assert ours is not None
        assert ours.shape == alone_.shape == (9, 48, 64, 3)
        assert np.abs(ours - alone_).max() <= PIXEL_TOLERANCE
    # Not the same video twice: the prompts and seeds reach their rows.
    assert np.abs(theirs[0] - theirs[1]).max() > 0.01


def test_what_a_call_shares_is_its_key(stage: WholeVideoStage) -> None:
    key = stage.batch_key(StageJob(dict(JOBS[0]), {}))
    for change in (
        {"width": 128},
        {"height": 64},
        {"num_frames": 17},
        {"num_inference_steps": 4},
        {"guidance_scale": 3.0},
        {"guidance_scale": None},
        {"negative_prompt": ""},
    ):
        assert stage.batch_key(StageJob({**JOBS[0], **change}, {})) != key
    # The prompt, the seed and the frame rate (the MP4's alone) do not part jobs.
    same = {**JOBS[0], "prompt": "other", "negative_prompt": "other", "seed": 99, "fps": 24}
    assert stage.batch_key(StageJob(same, {})) == key


def test_the_result_is_an_mp4_of_the_frames_at_the_jobs_rate(
    stage: WholeVideoStage, theirs: list[np.ndarray]
) -> None:
    [result] = stage.run_batch([StageJob({**JOBS[0], "fps": 12}, {})])
    [video] = result.outputs
    assert {k: video[k] for k in ("frames", "width", "height", "fps")} == {
        "frames": 9,
        "width": 64,
        "height": 48,
        "fps": 12,
    }
    with av.open(io.BytesIO(base64.b64decode(video["b64_mp4"]))) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 12
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
    assert decoded.shape == (9, 48, 64, 3)
    # H.264 at CRF 18 (and 4:2:0 colour) of random-weight noise: near the frames.
    assert np.abs(decoded / 255 - theirs[0]).mean() < 0.05


def test_unset_guidance_keeps_the_pipelines_and_each_step_is_reported(
    stage: WholeVideoStage, pipe: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router sends the steps and guidance the client left out as None: the call
    runs at CogVideoX's own guidance (6), and reports each step to the job and to the
    worker's watchdog."""
    asked = EXTENSIONS.video_params({"size": "32x32", "num_frames": 1, "num_inference_steps": 3})
    assert asked["guidance_scale"] is None
    params = {**asked, "prompt": "a cat", "seed": 3}
    steps: list[tuple[int, int]] = []
    job = StageJob(params, {})
    job.on_step = lambda step, total: steps.append((step, total))
    pokes: list[None] = []
    monkeypatch.setattr(stage, "progress", lambda: pokes.append(None))
    [ours] = stage.videos([job])
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert len(pokes) >= 3
    assert ours is not None
    assert np.abs(ours - alone(pipe, params)).max() <= PIXEL_TOLERANCE
    guided = alone(pipe, {**params, "guidance_scale": 2.0})
    assert np.abs(ours - guided).max() > 10 * PIXEL_TOLERANCE  # the guidance matters


def test_a_call_whose_jobs_are_all_cancelled_ends_before_decoding(
    stage: WholeVideoStage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its steps left unset, the job runs the pipeline's own count (CogVideoX's 50), the
    count each step reports; cancelled at the first, the call stops there."""
    asked = EXTENSIONS.video_params({"size": "64x48", "num_frames": 9})
    assert asked["num_inference_steps"] is None
    decodes: list[None] = []
    decode = stage.pipe.vae.decode

    def counted(*args: Any, **kwargs: Any) -> Any:
        decodes.append(None)
        return decode(*args, **kwargs)

    monkeypatch.setattr(stage.pipe.vae, "decode", counted)
    result, steps = cancelled_at_first_step(stage, {**asked, "prompt": "a cat", "seed": 0})
    assert result.outputs == []
    assert steps == [(1, 50)]  # the other 49 were skipped
    assert decodes == []


def test_a_cancelled_job_leaves_the_others_of_its_call_their_videos(
    stage: WholeVideoStage,
) -> None:
    small = {"width": 32, "height": 32, "num_frames": 1}
    kept, cancelled = (StageJob({**p, **small}, {}) for p in JOBS)
    seen: list[int] = []

    def cancel_at_second(step: int, total: int) -> None:
        seen.append(step)
        if step == 2:
            cancelled.cancelled.set()

    kept.on_step = lambda step, total: seen.append(step)
    cancelled.on_step = cancel_at_second
    first, second = stage.run_batch([kept, cancelled])
    assert [video["frames"] for video in first.outputs] == [1]
    assert second.outputs == []
    assert seen == [1, 1, 2, 2, 3, 3]  # the call went on to its last step for `kept`


def build_modelscope(target: Path) -> None:
    """ModelScope's TextToVideoSDPipeline, tiny: a pipeline whose steps are reported only
    through the older `callback`, called after each with the step's index."""
    from diffusers import DDIMScheduler, TextToVideoSDPipeline, UNet3DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    tokenizer = save_byte_tokenizer(target / "tokenizer", max_length=77)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    unet = UNet3DConditionModel(
        block_out_channels=(8, 8),
        layers_per_block=1,
        sample_size=8,
        in_channels=16,
        out_channels=16,
        down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=4,
    )
    pipe: Any = TextToVideoSDPipeline(
        vae=tiny_image_vae(),
        text_encoder=clip,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(),
    )
    pipe.save_pretrained(str(target))


def test_a_pipeline_with_the_older_step_callback_reports_and_stops(tmp_path: Path) -> None:
    build_modelscope(tmp_path)
    stage = loaded(str(tmp_path))
    assert "callback_on_step_end" not in stage.takes
    params = {"prompt": "a cat", "seed": 0, "width": 32, "height": 32, "num_frames": 2}
    steps: list[tuple[int, int]] = []
    job = StageJob({**params, "num_inference_steps": 3}, {})
    job.on_step = lambda step, total: steps.append((step, total))
    [result] = stage.run_batch([job])
    assert [video["frames"] for video in result.outputs] == [2]
    assert steps == [(1, 3), (2, 3), (3, 3)]
    cancelled = StageJob({**params, "num_inference_steps": 20}, {})
    cancelled.on_step = lambda step, total: (steps.append((step, total)), cancelled.cancelled.set())
    steps.clear()
    assert stage.run_batch([cancelled])[0].outputs == []
    assert steps == [(1, 20)]


def test_a_video_checkpoint_is_served_as_video_and_the_image_type_refuses_it() -> None:
    path = resolve_model_path(MODEL)
    assert manifest_for_model(MODEL, checkpoint_descriptors(path)).spec.pipeline == (
        "diffusers-video"
    )
    spec = spec_of("diffusers")
    image = stage_class(spec, path, "diffusers")(spec, path, "cpu")
    assert isinstance(image, WholePipelineStage)
    with pytest.raises(NotImplementedError, match="serve it as pipeline diffusers-video"):
        image.load()


def test_request_defaults_are_cogvideoxs_and_seconds_make_8k_plus_1_frames() -> None:
    assert EXTENSIONS.video_params({"prompt": "x"}) == {
        "width": 720,
        "height": 480,
        "fps": 8,
        "num_frames": 49,
        "num_inference_steps": None,
        "guidance_scale": None,
        "negative_prompt": "",
    }
    assert EXTENSIONS.video_params({"seconds": "2", "fps": "16"})["num_frames"] == 33
    assert EXTENSIONS.video_params({"seconds": 1.9})["num_frames"] == 17
    # num_frames, where given, decides (multipart sends it as text).
    assert EXTENSIONS.video_params({"seconds": "2", "num_frames": "25"})["num_frames"] == 25


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"size": "720x481"}, "size", "multiples of 16"),
        ({"size": "2048x1024"}, "size", "from 16 to 1360"),
        ({"size": "big"}, "size", "must look like 720x480"),
        ({"size": "\uff11\uff16x\uff11\uff16"}, "size", "must look like 720x480"),
        ({"num_frames": 13}, "num_frames", r"8k\+1 \(1, 9, 17"),
        ({"num_frames": 265}, "num_frames", "between 1 and 257"),
        ({"num_frames": 8.5}, "num_frames", "must be an integer"),
        ({"num_frames": "\u0665"}, "num_frames", "must be a number"),
        ({"seconds": "100"}, "seconds", "between"),
        ({"seconds": "nan"}, "seconds", "must be a number"),
        ({"fps": 0}, "fps", "between 1 and 60"),
        ({"fps": 10**400}, "fps", "must be a number"),
        ({"num_inference_steps": 500}, "num_inference_steps", "between 1 and 200"),
        ({"num_inference_steps": "1_0"}, "num_inference_steps", "must be a number"),
        ({"guidance_scale": -1}, "guidance_scale", "between 0 and 50"),
        ({"guidance_scale": True}, "guidance_scale", "must be a number"),
        ({"negative_prompt": 3}, "negative_prompt", "must be a string"),
        ({"negative_prompt": "x" * 32_001}, "negative_prompt", "at most 32000"),
        # Each inside its bound, together past the work a job may ask.
        ({"size": "1360x1360", "num_frames": 257}, "num_frames", "latent tokens, past"),
        ({"size": "1360x1360", "seconds": "32"}, "seconds", "latent tokens, past"),
        (
            {"size": "1360x768", "num_frames": 161, "num_inference_steps": 60},
            "num_inference_steps",
            "take at most 50 steps",
        ),
    ],
)
def test_what_a_request_cannot_ask_is_refused_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(RequestProblem, match=words) as err:
        EXTENSIONS.video_params(fields)
    assert err.value.param == param


def test_the_largest_video_inside_the_bounds_is_taken() -> None:
    made = EXTENSIONS.video_params(
        {"size": "1360x768", "num_frames": 161, "num_inference_steps": 50}
    )
    assert (made["width"], made["height"], made["num_frames"]) == (1360, 768, 161)


def test_the_image_endpoints_send_the_client_to_v1_videos() -> None:
    with pytest.raises(RequestProblem, match="POST /v1/videos"):
        EXTENSIONS.image_params({"prompt": "x"})
    with pytest.raises(RequestProblem, match="POST /v1/videos"):
        EXTENSIONS.chat_image_params({"prompt": "x"}, lambda size: (1, 1))
