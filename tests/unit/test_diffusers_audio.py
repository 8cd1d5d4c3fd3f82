"""The diffusers fallback's audio type (`pipeline: diffusers-audio`) on AudioLDM: requests
run in one call of the pipeline equal the pipeline's own audio for each alone; the audio
leaves as 16-bit PCM or encoded, at the vocoder's rate; unset settings keep the
pipeline's defaults and each step is reported; a call whose requests are all cancelled
stops; the request checks refuse by field what the pipeline cannot be asked."""

from __future__ import annotations

import base64
import io
from typing import Any

import av
import numpy as np
import pytest
import torch

from omnipipe.api.families import RequestProblem
from omnipipe.api.from_model import checkpoint_descriptors, manifest_for_model
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.diffusers_any.audio import WholeAudioStage, mono
from omnipipe.families.diffusers_any.audio_requests import EXTENSIONS, MAX_AUDIO_SECONDS
from omnipipe.families.diffusers_any.stage import WholePipelineStage
from omnipipe.stagekit.stage import StageInputError, StageJob
from tests.harness.fallback import cancelled_at_first_step, fallback_stage

pytestmark = pytest.mark.timeout(120)
MODEL = "tiny://audioldm"
RATE = 16_000  # the tiny vocoder's, as released
BASE = {"audio_length": 0.5, "num_inference_steps": 3, "guidance_scale": 3.0}
REQUESTS = [
    {**BASE, "prompt": "a dog barking in the rain", "negative_prompt": "music", "seed": 1},
    {**BASE, "prompt": "a church bell", "negative_prompt": "low quality", "seed": 7},
]
# Float rounding: one call of several rows against the pipeline's calls of one.
TOLERANCE = 1e-4
# And the 16-bit samples the stage sends: the nearest step to each.
PCM_TOLERANCE = TOLERANCE + 1 / 32767


@pytest.fixture(scope="module")
def stage() -> WholeAudioStage:
    loaded = fallback_stage(MODEL, "diffusers-audio", WholeAudioStage)
    loaded.load()
    return loaded


def heard(pcm: bytes) -> np.ndarray:
    """16-bit PCM as the waveform's floats."""
    return np.frombuffer(pcm, dtype="<i2") / 32767


def alone(stage: WholeAudioStage, params: dict[str, Any]) -> np.ndarray:
    """The pipeline's own audio for one request alone."""
    with torch.inference_mode():
        return np.asarray(
            stage.pipe(
                prompt=params["prompt"],
                negative_prompt=params["negative_prompt"],
                audio_length_in_s=params["audio_length"],
                num_inference_steps=params["num_inference_steps"],
                guidance_scale=params["guidance_scale"],
                generator=torch.Generator().manual_seed(params["seed"]),
                output_type="np",
            ).audios[0]
        )


def test_requests_in_one_call_equal_the_pipeline_for_each_alone(stage: WholeAudioStage) -> None:
    jobs = [StageJob(dict(p), {}) for p in REQUESTS]
    assert len({stage.batch_key(j) for j in jobs}) == 1
    made = stage.waveforms(jobs)
    for params, ours in zip(REQUESTS, made, strict=True):
        assert ours is not None
        theirs = alone(stage, params)
        assert ours.shape == theirs.shape == (int(0.5 * RATE),)
        assert np.abs(ours - theirs).max() <= TOLERANCE
        # Not silence: the comparison above would hold for any two quiet signals.
        assert np.abs(ours).max() > 0.05
    first, second = made
    assert first is not None
    assert second is not None
    assert np.abs(first - second).max() > 0.05  # each request its own prompt and seed


def test_the_audio_leaves_as_pcm_or_in_the_requested_format(stage: WholeAudioStage) -> None:
    job = StageJob(dict(REQUESTS[0]), {})
    [waveform] = stage.waveforms([job])
    assert waveform is not None
    asked = [{"response_format": f} for f in ("wav", "flac", "mp3")]
    asked.append({"response_format": "pcm", "speed": 2.0})
    results = stage.run_batch([StageJob({**REQUESTS[0], **a}, {}) for a in asked])
    wav, flac, mp3, faster = (r.outputs for r in results)
    assert [o["sample_rate"] for o in (*wav, *flac, *mp3, *faster)] == [RATE] * 4
    # wav's header is the router's: the stage sends the PCM itself.
    assert np.abs(heard(base64.b64decode(wav[0]["audio"])) - waveform).max() <= PCM_TOLERANCE
    with av.open(io.BytesIO(base64.b64decode(flac[0]["audio"]))) as container:
        samples = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    assert np.abs(heard(samples.astype("<i2").tobytes()) - waveform).max() <= PCM_TOLERANCE
    with av.open(io.BytesIO(base64.b64decode(mp3[0]["audio"]))) as container:
        frames = list(container.decode(audio=0))
    assert frames[0].sample_rate == RATE
    # MP3 pads the end by up to a frame (576 samples at 16 kHz, and the encoder's delay).
    assert sum(f.samples for f in frames) / RATE == pytest.approx(0.5, abs=0.1)
    # Twice the speed, half the length (atempo's edges aside).
    stretched = len(base64.b64decode(faster[0]["audio"])) // 2
    assert stretched / RATE == pytest.approx(0.25, abs=0.02)


def test_what_a_call_shares_is_its_key(stage: WholeAudioStage) -> None:
    key = stage.batch_key(StageJob(dict(REQUESTS[0]), {}))
    for change in (
        {"audio_length": 1.0},
        {"num_inference_steps": 4},
        {"guidance_scale": 2.0},
        {"negative_prompt": None},
    ):
        assert stage.batch_key(StageJob({**REQUESTS[0], **change}, {})) != key
    # Each row has its own prompt, seed and format.
    same = {**REQUESTS[0], "prompt": "other", "seed": 99, "response_format": "mp3"}
    assert stage.batch_key(StageJob(same, {})) == key


def test_unset_settings_keep_the_pipelines_defaults_and_each_step_is_reported(
    stage: WholeAudioStage,
) -> None:
    params = {"prompt": "rain on a tin roof", "seed": 3, **EXTENSIONS.audio_params({})}
    assert params["audio_length"] is None
    steps: list[tuple[int, int]] = []
    job = StageJob(params, {})
    job.on_step = lambda step, total: steps.append((step, total))
    [waveform] = stage.waveforms([job])
    # AudioLDMPipeline's own defaults: 10 steps, and its UNet's sample size in length
    # (32 latent frames, 4x down, 10 ms each).
    assert steps == [(i, 10) for i in range(1, 11)]
    assert waveform is not None
    assert waveform.shape == (int(1.28 * RATE),)


def test_a_call_whose_requests_are_all_cancelled_stops(stage: WholeAudioStage) -> None:
    result, steps = cancelled_at_first_step(stage, {**REQUESTS[0], "num_inference_steps": 20})
    assert result.outputs == []
    assert steps == [(1, 20)]  # the other 19 were skipped


def test_a_cancelled_request_leaves_the_others_of_its_call(stage: WholeAudioStage) -> None:
    gone, kept = (StageJob(dict(p), {}) for p in REQUESTS)
    steps: list[int] = []
    gone.on_step = lambda step, total: gone.cancelled.set()
    kept.on_step = lambda step, total: steps.append(step)
    left, right = stage.run_batch([gone, kept])
    assert left.outputs == []
    assert steps == [1, 2, 3]
    [audio] = right.outputs
    theirs = alone(stage, REQUESTS[1])
    assert np.abs(heard(base64.b64decode(audio["audio"])) - theirs).max() <= PCM_TOLERANCE


def test_a_length_the_pipeline_cannot_make_is_the_clients_error(stage: WholeAudioStage) -> None:
    """Shorter than one latent frame (40 ms here): AudioLDM's own check, named as the
    client's field."""
    job = StageJob({**REQUESTS[0], "audio_length": 0.01}, {})
    with pytest.raises(StageInputError, match=r"^`audio_length` has to be") as refused:
        stage.waveforms([job])
    assert refused.value.param == "audio_length"


def test_a_stereo_waveform_leaves_as_one_channel() -> None:
    left, right = np.full(4, 0.5, np.float32), np.full(4, -0.25, np.float32)
    np.testing.assert_array_equal(mono(np.stack([left, right])), np.full(4, 0.125))
    np.testing.assert_array_equal(mono(left), left)


def test_the_model_named_alone_is_served_as_audio_and_no_other_type_runs_it() -> None:
    path = resolve_model_path(MODEL)
    assert manifest_for_model(MODEL, checkpoint_descriptors(path)).spec.pipeline == (
        "diffusers-audio"
    )
    image_stage = fallback_stage(MODEL, "diffusers", WholePipelineStage)
    with pytest.raises(
        NotImplementedError,
        match="AudioLDMPipeline makes audio: serve it as pipeline diffusers-audio, not diffusers",
    ):
        image_stage.load()


def test_settings_within_bounds_become_the_stages_parameters() -> None:
    asked = {"audio_length": 10, "num_inference_steps": 50, "guidance_scale": 3.5}
    assert EXTENSIONS.audio_params({**asked, "negative_prompt": "hiss", "audio_start": 0}) == {
        "audio_length": 10.0,
        "num_inference_steps": 50,
        "guidance_scale": 3.5,
        "negative_prompt": "hiss",
    }
    # A negative prompt beside the pipeline's own guidance (2.5 for AudioLDM) is not refused.
    assert EXTENSIONS.audio_params({"negative_prompt": "hiss"})["guidance_scale"] is None


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("audio_length", 0, "above 0"),
        ("audio_length", -1.5, "above 0"),
        ("audio_length", MAX_AUDIO_SECONDS + 1, f"at most {MAX_AUDIO_SECONDS:g}"),
        ("audio_length", "5", "must be a number"),
        ("audio_length", True, "must be a number"),
        ("num_inference_steps", 0, "from 1 to 200"),
        ("num_inference_steps", 201, "from 1 to 200"),
        ("num_inference_steps", 2.5, "an integer"),
        ("guidance_scale", -1, "from 0 to 50"),
        ("guidance_scale", 51, "from 0 to 50"),
        ("guidance_scale", float("nan"), "from 0 to 50"),
        ("negative_prompt", 5, "must be a string"),
        ("negative_prompt", "x" * 32_001, "at most 32000 characters"),
        ("audio_start", 2.0, "from its start"),
    ],
)
def test_settings_out_of_bounds_are_refused_naming_the_field(
    field: str, value: Any, said: str
) -> None:
    with pytest.raises(RequestProblem, match=said) as refused:
        EXTENSIONS.audio_params({field: value})
    assert refused.value.param == field


def test_a_negative_prompt_the_guidance_would_ignore_is_refused() -> None:
    with pytest.raises(RequestProblem, match="above 1") as refused:
        EXTENSIONS.audio_params({"negative_prompt": "hiss", "guidance_scale": 1.0})
    assert refused.value.param == "guidance_scale"


def test_the_image_endpoints_are_pointed_to_audio_generate() -> None:
    for ask in (
        lambda: EXTENSIONS.image_params({"prompt": "x"}),
        lambda: EXTENSIONS.chat_image_params({}, lambda size: (1, 1)),
    ):
        with pytest.raises(RequestProblem, match=r"POST /v1/audio/generate"):
            ask()
