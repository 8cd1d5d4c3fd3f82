"""POST /v1/audio/generate through the router, on a diffusers-audio pipeline whose stage is
a fake worker (tests/unit/test_router_results.py; the real stage answers in
tests/e2e/test_diffusers_audio.py): the body reaches the stage as its parameters, the
stage's audio comes back in the requested container, and bad input is an OpenAI-shaped
400 naming the field that reaches no stage. The pipeline's other endpoints name this one;
a pipeline that makes no audio has no such endpoint."""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from omnipipe.api import ResolvedPipeline, parse_resource, resolve
from omnipipe.api.wire import StageEvent, SubmitRequest, event_lines
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings
from tests.unit import test_router_results
from tests.unit.test_router_results import FakeWorker, results

pytestmark = pytest.mark.timeout(60)
serve_worker = test_router_results.serve_worker
RATE = 16_000
PCM = (np.sin(np.arange(800) / 5) * 9000).astype("<i2").tobytes()
# What a stage sends for an encoded format: the router passes its bytes on as they are.
ENCODED = b"ID3 encoded by the stage"


def audio_pipeline(model: str = "tiny://audioldm", kind: str = "diffusers-audio") -> Any:
    doc = {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "sounds"},
        "spec": {"model": model, "pipeline": kind},
    }
    return resolve(parse_resource(doc))


def the_stages_audio(body: SubmitRequest) -> Iterator[bytes]:
    """As WholeAudioStage answers: PCM for wav and pcm, else the encoded bytes."""
    encoded = body.params.get("response_format") not in ("wav", "pcm")
    data = ENCODED if encoded else PCM
    audio = {"audio": base64.b64encode(data).decode(), "sample_rate": RATE}
    return results(audio)(body)


def client_for(tmp_path: Path, resolved: ResolvedPipeline, urls: list[str]) -> TestClient:
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: urls for s in resolved.stages}))
    settings = RouterSettings(replicas_file=str(replicas), wake_wait_seconds=0)
    return TestClient(build_app(resolved, settings), raise_server_exceptions=False)


@pytest.fixture
def fake_stage(serve_worker: Callable[[FakeWorker], str]) -> tuple[FakeWorker, str]:
    worker = FakeWorker(the_stages_audio)
    return worker, serve_worker(worker)


def openai_error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_the_body_reaches_the_stage_and_its_audio_comes_back_as_asked(
    tmp_path: Path, fake_stage: tuple[FakeWorker, str]
) -> None:
    worker, url = fake_stage
    asked = {
        "input": "a dog barking",
        "audio_length": 2.5,
        "num_inference_steps": 4,
        "guidance_scale": 3.0,
        "negative_prompt": "music",
        "seed": 11,
        "speed": 1.5,
    }
    with client_for(tmp_path, audio_pipeline(), [url]) as client:
        wav = client.post("/v1/audio/generate", json=asked)
        pcm = client.post("/v1/audio/generate", json={"input": "rain", "response_format": "pcm"})
        mp3 = client.post(
            "/v1/audio/generate",
            json={"input": "rain", "model": "sounds", "response_format": "mp3"},
        )
    assert wav.status_code == 200, wav.text
    assert wav.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(wav.content)) as read:
        assert (read.getframerate(), read.getnchannels(), read.getsampwidth()) == (RATE, 1, 2)
        assert read.readframes(read.getnframes()) == PCM
    assert (pcm.status_code, pcm.content) == (200, PCM)
    assert pcm.headers["x-sample-rate"] == str(RATE)
    assert pcm.headers["x-sample-format"] == "s16le"
    assert (mp3.status_code, mp3.content, mp3.headers["content-type"]) == (
        200,
        ENCODED,
        "audio/mpeg",
    )
    first, second, _ = (s.params for s in worker.submitted)
    assert first == {
        "prompt": "a dog barking",
        "audio_length": 2.5,
        "num_inference_steps": 4,
        "guidance_scale": 3.0,
        "negative_prompt": "music",
        "seed": 11,
        "response_format": "wav",
        "speed": 1.5,
    }
    # Unset settings are the pipeline's; a seed is drawn where the client chose none.
    assert [second[k] for k in ("audio_length", "num_inference_steps", "guidance_scale")] == [
        None,
        None,
        None,
    ]
    assert isinstance(second["seed"], int)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": "   "}, "input"),
        ({}, "input"),
        ({"input": "x", "audio_length": 0}, "audio_length"),
        ({"input": "x", "audio_length": 1000}, "audio_length"),
        ({"input": "x", "audio_length": "5"}, "audio_length"),
        ({"input": "x", "num_inference_steps": 0}, "num_inference_steps"),
        ({"input": "x", "num_inference_steps": 1.5}, "num_inference_steps"),
        ({"input": "x", "guidance_scale": 99}, "guidance_scale"),
        ({"input": "x", "negative_prompt": "hiss", "guidance_scale": 1}, "guidance_scale"),
        ({"input": "x", "audio_start": 3}, "audio_start"),
        ({"input": "x", "response_format": "ogg"}, "response_format"),
        ({"input": "x", "speed": 9}, "speed"),
        ({"input": "x", "stream_format": "sse"}, "stream_format"),
        ({"input": "x", "seed": -1}, "seed"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_reaches_no_stage(
    tmp_path: Path, fake_stage: tuple[FakeWorker, str], body: dict[str, Any], param: str
) -> None:
    worker, url = fake_stage
    with client_for(tmp_path, audio_pipeline(), [url]) as client:
        error = openai_error(client.post("/v1/audio/generate", json=body), 400)
    assert error["param"] == param, error
    assert worker.submitted == []


def test_a_setting_the_loaded_model_refuses_is_a_400_naming_it(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """What only the model knows (AudioLDM's shortest length, one latent frame) the
    stage refuses; the client gets the stage's words and field."""
    refusal = StageEvent(
        type="error",
        code="invalid_request",
        message="`audio_length` has to be a positive value greater than or equal to 0.04",
        param="audio_length",
    )
    url = serve_worker(FakeWorker(lambda _body: iter(event_lines(refusal))))
    with client_for(tmp_path, audio_pipeline(), [url]) as client:
        error = openai_error(
            client.post("/v1/audio/generate", json={"input": "x", "audio_length": 0.01}), 400
        )
    assert (error["param"], error["message"]) == ("audio_length", refusal.message)


def test_an_unknown_model_is_a_404(tmp_path: Path, fake_stage: tuple[FakeWorker, str]) -> None:
    worker, url = fake_stage
    with client_for(tmp_path, audio_pipeline(), [url]) as client:
        error = openai_error(
            client.post("/v1/audio/generate", json={"input": "x", "model": "other"}), 404
        )
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert worker.submitted == []


@pytest.mark.parametrize(
    "path",
    [
        "/v1/images/generations",
        "/v1/images/edits",
        "/v1/chat/completions",
        "/v1/audio/speech",
        "/v1/omni/generate",
        "/v1/videos",
    ],
)
def test_the_other_endpoints_name_audio_generate(
    tmp_path: Path, fake_stage: tuple[FakeWorker, str], path: str
) -> None:
    worker, url = fake_stage
    with client_for(tmp_path, audio_pipeline(), [url]) as client:
        error = openai_error(client.post(path, json={"model": "sounds", "prompt": "x"}), 400)
        documented = client.get("/openapi.json").json()["paths"]
    assert "POST /v1/audio/generate" in error["message"]
    assert error["param"] == "model"
    assert worker.submitted == []
    assert "/v1/audio/generate" in documented
    assert path not in documented


def test_a_pipeline_that_makes_no_audio_has_no_audio_generate(
    tmp_path: Path, fake_stage: tuple[FakeWorker, str]
) -> None:
    _, url = fake_stage
    images = audio_pipeline("tiny://sd3", "diffusers")
    with client_for(tmp_path, images, [url]) as client:
        error = openai_error(client.post("/v1/audio/generate", json={"input": "x"}), 404)
        documented = client.get("/openapi.json").json()["paths"]
    assert error["message"] == "Invalid URL (POST /v1/audio/generate)"
    assert "/v1/audio/generate" not in documented
    assert "/v1/images/generations" in documented
