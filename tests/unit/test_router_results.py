"""Results of any size from a stage to the client: the wire splits long fields into
parts, the router reads bounded lines and forwards images piece by piece, and anything
wrong in a stage's stream becomes an OpenAI-shaped error."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient

from omnipipe.api import load_file, resolve
from omnipipe.api.constants import CREDENTIAL_HEADER
from omnipipe.api.wire import PART_CHARS, StageEvent, SubmitRequest, event_lines
from omnipipe.local.ports import free_port
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings
from omnipipe.router.stage_events import PartAssembler, StreamBroken, event_stream

REPO = Path(__file__).resolve().parents[2]
IMAGE = resolve(load_file(REPO / "examples/tiny-text-to-image.yaml"))
OMNI = resolve(load_file(REPO / "examples/tiny-omni.yaml"))
CREDENTIAL = "pipeline-secret"


class Chunks:
    """A byte source that hands out a stream in fixed-size reads."""

    def __init__(self, data: bytes, size: int) -> None:
        self.data, self.size = data, size

    async def readany(self) -> bytes:
        piece, self.data = self.data[: self.size], self.data[self.size :]
        return piece


async def read_all(data: bytes, size: int = 4096, max_line: int = 1 << 20) -> list[StageEvent]:
    return [e async for e in event_stream(Chunks(data, size), max_line)]


def test_long_fields_travel_as_parts_and_come_back_whole() -> None:
    big = base64.b64encode(os.urandom(3 * PART_CHARS)).decode()  # 4 parts
    event = StageEvent(type="result", index=2, data={"b64_json": big, "seed": 7})
    lines = list(event_lines(event))
    assert len(lines) == 5
    assert all(len(line) < PART_CHARS + 200 for line in lines)
    parts = PartAssembler()
    for line in lines[:-1]:
        part = StageEvent.model_validate_json(line)
        assert (part.type, part.index, part.key) == ("part", 2, "b64_json")
        parts.add(part)
    last = StageEvent.model_validate_json(lines[-1])
    assert last.data == {"seed": 7}
    assert parts.complete(last) == {"b64_json": big, "seed": 7}


def test_escaped_text_splits_anywhere() -> None:
    text = 'quote " backslash \\ newline \n snowman \u2603 emoji \U0001f600 ' * 20
    lines = list(event_lines(StageEvent(type="result", data={"text": text}), part_chars=7))
    assert len(lines) > 50
    assert all(line.count(b"\n") == 1 for line in lines)
    parts = PartAssembler()
    for line in lines[:-1]:
        parts.add(StageEvent.model_validate_json(line))
    assert parts.complete(StageEvent.model_validate_json(lines[-1])) == {"text": text}


@pytest.mark.parametrize("size", [1, 7, 65536])
async def test_lines_are_found_whatever_the_reads(size: int) -> None:
    stream = b"".join(
        line
        for e in (
            StageEvent(type="result", data={"b64_json": "x" * 5000}),
            StageEvent(type="done"),
        )
        for line in event_lines(e, part_chars=1000)
    )
    events = await read_all(b"\n" + stream, size)
    assert [e.type for e in events] == ["part"] * 5 + ["result", "done"]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"x" * 5000, "longer than 4096"),
        (b'{"type": "result"', "ended inside an event"),
        (b'{"type": "bogus"}\n', "malformed"),
        (b"not json\n", "malformed"),
        (b'{"type": "part", "text": "x"}\n', "without a key"),
        (b'{"type": "part", "key": "k"}\n{"type": "done"}\n', "interrupted"),
        (b'{"type": "part", "key": "k"}\n{"type": "result", "index": 1}\n', "interrupted"),
        (b'{"type": "part", "key": "k"}\n{"type": "part", "key": "k", "index": 1}\n', "interr"),
    ],
)
async def test_broken_streams_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(StreamBroken, match=match):
        await read_all(data, size=1000, max_line=4096)


@dataclass
class FakeWorker:
    """A stage worker's control API on loopback whose emitting stage answers with
    whatever `emit` writes; it records what the router sent."""

    emit: Callable[[SubmitRequest], Iterator[bytes]]
    credentials: list[str | None] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    traceparents: list[str | None] = field(default_factory=list)
    submitted: list[SubmitRequest] = field(default_factory=list)
    voices: list[str] | None = None  # GET /control/voices; None: a worker without it
    # POST /control/voice_prompt: the status and body it answers a call's body with;
    # None: a worker without it. Each call's body is kept.
    voice_prompt: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]] | None = None
    prompt_calls: list[dict[str, Any]] = field(default_factory=list)
    # The `done` event's data of a stage that emits nothing (what it counted).
    done_data: Callable[[SubmitRequest], dict[str, Any]] = lambda _body: {}

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/ready")
        async def ready() -> dict[str, object]:
            return {
                "pipeline": "p",
                "stage": "s",
                "ready": True,
                "draining": False,
                "running": 0,
                "waiting": 0,
                "transfer_address": "tcp://127.0.0.1:1",
            }

        @app.get("/control/voices")
        async def voices() -> JSONResponse:
            if self.voices is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse({"stage": "s", "voices": self.voices})

        @app.post("/control/voice_prompt")
        async def voice_prompt(request: Request) -> JSONResponse:
            if self.voice_prompt is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            body = await request.json()
            self.prompt_calls.append(body)
            status, answer = self.voice_prompt(body)
            return JSONResponse(answer, status_code=status)

        @app.post("/v1/requests")
        async def submit(request: Request) -> StreamingResponse:
            self.credentials.append(request.headers.get(CREDENTIAL_HEADER))
            self.traceparents.append(request.headers.get("traceparent"))
            # The body's model forbids unknown fields, as a worker of an older release does.
            body = SubmitRequest.model_validate_json(await request.body())
            self.submitted.append(body)

            async def events() -> AsyncIterator[bytes]:
                if body.emit:
                    # In a thread: an `emit` that sleeps stalls its stream, not this fake
                    # worker's loop, which still answers cancels and readiness at once.
                    lines = self.emit(body)
                    while (line := await asyncio.to_thread(next, lines, None)) is not None:
                        yield line
                else:
                    done = StageEvent(type="done", data=self.done_data(body))
                    yield done.model_dump_json().encode() + b"\n"

            return StreamingResponse(events(), media_type="application/x-ndjson")

        @app.post("/v1/requests/{request_id}/cancel")
        async def cancel(request_id: str, request: Request) -> JSONResponse:
            self.credentials.append(request.headers.get(CREDENTIAL_HEADER))
            self.cancelled.append(request_id)
            return JSONResponse({"cancelled": True})

        return app


@pytest.fixture
def serve_worker() -> Iterator[Callable[[FakeWorker], str]]:
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(worker: FakeWorker) -> str:
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(worker.app(), host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the fake worker did not start"
            time.sleep(0.01)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


def router(tmp_path: Path, url: str, pipeline: str = "image", **settings: object) -> TestClient:
    resolved = IMAGE if pipeline == "image" else OMNI
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: [url] for s in resolved.stages}))
    app = build_app(
        resolved,
        RouterSettings(
            replicas_file=str(replicas),
            pipeline_credential=CREDENTIAL,
            wake_wait_seconds=0,
            **settings,  # type: ignore[arg-type]
        ),
    )
    return TestClient(app, raise_server_exceptions=False)


def results(*datas: dict[str, object]) -> Callable[[SubmitRequest], Iterator[bytes]]:
    def emit(_body: SubmitRequest) -> Iterator[bytes]:
        for i, data in enumerate(datas):
            yield from event_lines(StageEvent(type="result", index=i, data=data))
        yield StageEvent(type="done").model_dump_json().encode() + b"\n"

    return emit


def generate(client: TestClient, n: int = 1) -> dict[str, object]:
    resp = client.post(
        "/v1/images/generations", json={"model": "tiny-image", "prompt": "x", "n": n}
    )
    body: dict[str, object] = resp.json()
    assert resp.status_code == 200, body
    return body


def test_images_of_megabytes_arrive_whole(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    images = [base64.b64encode(os.urandom(3_000_000 + i)).decode() for i in range(3)]
    extras: list[dict[str, object]] = [{"revised_prompt": 'r"1'}, {}, {"revised_prompt": ""}]
    worker = FakeWorker(
        results(*({"b64_json": b, **e} for b, e in zip(images, extras, strict=True)))
    )
    with router(tmp_path, serve_worker(worker)) as client:
        body = generate(client, n=3)
    assert body["data"] == [{"b64_json": b, **e} for b, e in zip(images, extras, strict=True)]
    # Every call to every stage carried the pipeline credential.
    assert set(worker.credentials) == {CREDENTIAL}


def test_small_results_and_no_results(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    small = FakeWorker(results({"b64_json": "aGk="}))
    with router(tmp_path, serve_worker(small)) as client:
        assert generate(client)["data"] == [{"b64_json": "aGk="}]
    nothing = FakeWorker(results())
    with router(tmp_path, serve_worker(nothing)) as client:
        body = generate(client)
    assert body["data"] == []
    assert "usage" not in body  # no stage counted anything: no usage is made up


def test_what_the_stages_count_adds_up_to_the_images_usage(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """The encoder's prompt tokens and the denoiser's image tokens, each sent with its
    `done`, become OpenAI's usage; a count the router does not know, or not a whole
    non-negative number, is left out."""

    def counted(body: SubmitRequest) -> dict[str, Any]:
        if not body.inputs:  # the text encoder
            return {"usage": {"text_tokens": 12, "seconds": 3}}
        return {"usage": {"output_tokens": 2 * 64, "image_tokens": -1, "text_tokens": True}}

    worker = FakeWorker(results({"b64_json": "aGk="}, {"b64_json": "aGk="}), done_data=counted)
    with router(tmp_path, serve_worker(worker)) as client:
        body = generate(client, n=2)
    assert len(body["data"]) == 2  # type: ignore[arg-type]
    assert body["usage"] == {
        "input_tokens": 12,
        "input_tokens_details": {"image_tokens": 0, "text_tokens": 12},
        "output_tokens": 128,
        "output_tokens_details": {"image_tokens": 128, "text_tokens": 0},
        "total_tokens": 140,
    }


def test_a_minute_of_audio_in_one_result_reaches_speech_and_chat(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    pcm = os.urandom(60 * 24_000 * 2)
    audio = {"audio": base64.b64encode(pcm).decode(), "sample_rate": 24_000}
    text = {"text": "hello", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1}

    def emit(body: SubmitRequest) -> Iterator[bytes]:
        yield from results(text if "messages" in body.params else audio)(body)

    with router(tmp_path, serve_worker(FakeWorker(emit)), pipeline="omni") as client:
        speech = client.post(
            "/v1/audio/speech",
            json={"model": "tiny-omni", "input": "hi", "response_format": "pcm"},
        )
        assert speech.status_code == 200, speech.text
        assert speech.content == pcm
        chat = client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-omni",
                "messages": [{"role": "user", "content": "hi"}],
                "modalities": ["text", "audio"],
                "audio": {"format": "pcm16"},
            },
        )
    assert chat.status_code == 200, chat.text
    message = chat.json()["choices"][0]["message"]
    assert message["content"] == "hello"
    assert base64.b64decode(message["audio"]["data"]) == pcm


def openai_error(resp: object) -> dict[str, object]:
    body = resp.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, object] = body["error"]
    return error


def oversized_line(_body: SubmitRequest) -> Iterator[bytes]:
    # One line past the reader's bound: a list is never split into parts.
    yield (
        StageEvent(type="result", data={"many": list(range(1_200_000))}).model_dump_json().encode()
    )
    yield b"\n"


def _raw(*lines: bytes) -> Callable[[SubmitRequest], Iterator[bytes]]:
    def emit(_body: SubmitRequest) -> Iterator[bytes]:
        yield from lines

    return emit


@pytest.mark.parametrize(
    ("emit", "status", "message"),
    [
        (oversized_line, 500, "longer than"),
        (_raw(b"garbage\n"), 500, "malformed"),
        (_raw(b'{"type": "result", "data": {"b64_json": "aGk="}'), 500, "inside an event"),
        (_raw(b'{"type": "part", "text": "x"}\n'), 500, "without a key"),
        (_raw(), 503, "closed the stream early"),
        (
            _raw(*event_lines(StageEvent(type="error", code="invalid_request", message="bad"))),
            400,
            "bad",
        ),
    ],
)
def test_a_broken_stage_stream_is_a_clean_openai_error(
    tmp_path: Path,
    serve_worker: Callable[[FakeWorker], str],
    emit: Callable[[SubmitRequest], Iterator[bytes]],
    status: int,
    message: str,
) -> None:
    worker = FakeWorker(emit)
    with router(tmp_path, serve_worker(worker)) as client:
        resp = client.post("/v1/images/generations", json={"model": "tiny-image", "prompt": "x"})
    assert resp.status_code == status, resp.text
    assert message in str(openai_error(resp)["message"])
    # Every stage of the failed request was told to stop, with the credential.
    assert len(worker.cancelled) == len(IMAGE.stages)
    assert set(worker.credentials) == {CREDENTIAL}


def test_a_stream_that_stalls_after_its_first_output_ends_in_a_timeout_event(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """The handler reads a streamed response's first output, Starlette's task the rest:
    the timeout must still end the stream with an SSE error event (and cancel every
    stage), not drop the client's connection."""
    text = {"text": "hello", "finish_reason": None, "prompt_tokens": 1, "completion_tokens": 1}

    def stall(_body: SubmitRequest) -> Iterator[bytes]:
        yield from event_lines(StageEvent(type="result", data=text))
        time.sleep(3)  # stalls this stream; the router's timeout is 1 s
        yield StageEvent(type="done").model_dump_json().encode() + b"\n"

    worker = FakeWorker(stall)
    started = time.monotonic()
    with router(
        tmp_path, serve_worker(worker), pipeline="omni", request_timeout_seconds=1.0
    ) as client:
        resp = client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-omni",
                "messages": [{"role": "user", "content": "hi"}],
                "modalities": ["text"],
                "stream": True,
            },
        )
    assert resp.status_code == 200
    events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line]
    assert events[-1] == "[DONE]", events
    # The same OpenAI error object as a response body's, param included.
    assert json.loads(events[-2]) == {
        "error": {
            "message": "request took longer than 1s",
            "type": "timeout",
            "param": None,
            "code": None,
        }
    }
    assert "hello" in events[-3]
    assert time.monotonic() - started < 10
    assert worker.cancelled


def test_a_clients_traceparent_reaches_every_stage_as_a_header(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """Tracing off: the router passes the client's trace context on untouched, in the W3C
    header (never in the body, which an older worker would refuse), and adds none."""
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    worker = FakeWorker(results({"b64_json": "aGk="}))
    with router(tmp_path, serve_worker(worker)) as client:
        resp = client.post(
            "/v1/images/generations",
            json={"model": "tiny-image", "prompt": "x"},
            headers={"traceparent": traceparent},
        )
        assert resp.status_code == 200, resp.text
        assert worker.traceparents == [traceparent] * len(IMAGE.stages)
        generate(client)
    assert worker.traceparents[len(IMAGE.stages) :] == [None] * len(IMAGE.stages)


def test_every_omni_generate_line_has_a_request_id_even_when_the_client_gave_none(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """Unnamed, a request is named by the router (omni-<32 hex>), the same on every line,
    and two such requests are told apart."""
    url = serve_worker(FakeWorker(results({"b64_json": "AAAA"})))
    with router(tmp_path, url) as client:
        ids = []
        for _ in range(2):
            resp = client.post("/v1/omni/generate", json={"model": "tiny-image", "prompt": "a cat"})
            assert resp.status_code == 200, resp.text
            lines = [json.loads(line) for line in resp.text.splitlines()]
            assert lines[-1]["type"] == "done"
            [request_id] = {line["request_id"] for line in lines}
            assert re.fullmatch(r"omni-[0-9a-f]{32}", request_id), request_id
            ids.append(request_id)
        assert ids[0] != ids[1]
        named = client.post(
            "/v1/omni/generate",
            json={"model": "tiny-image", "prompt": "a cat", "request_id": "mine"},
        )
        assert {json.loads(line)["request_id"] for line in named.text.splitlines()} == {"mine"}


def test_omni_generate_leaves_out_code2wavs_empty_last_piece(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """code2wav's last piece carries no audio, only the count of codes speech's usage
    reads: a client of /v1/omni/generate gets the audio pieces and nothing empty."""
    audio = {"audio": base64.b64encode(b"\1\0" * 8).decode(), "sample_rate": 24_000}
    last = {"audio": "", "sample_rate": 24_000, "codes": 5}
    answer = {"text": "hi", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 1}

    def emit(body: SubmitRequest) -> Iterator[bytes]:
        thinker = "messages" in body.params
        return results(answer)(body) if thinker else results(audio, last)(body)

    with router(tmp_path, serve_worker(FakeWorker(emit)), pipeline="omni") as client:
        resp = client.post(
            "/v1/omni/generate",
            json={"model": "tiny-omni", "prompt": "hi", "output_modalities": ["text", "audio"]},
        )
    assert resp.status_code == 200, resp.text
    outputs = [json.loads(line) for line in resp.text.splitlines()]
    audios = [o["data"] for o in outputs if o["type"] == "output" and o["modality"] == "audio"]
    assert audios == [audio]


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"stream_format": "ogg"}, 400, "stream_format"),
        ({"stream_format": "sse", "response_format": "wav"}, 400, "response_format"),
        ({"stream_format": "audio"}, 200, None),
        ({"stream_format": "sse"}, 200, None),
    ],
)
def test_speech_serves_the_stream_formats_it_has_and_names_the_rest(
    tmp_path: Path,
    serve_worker: Callable[[FakeWorker], str],
    extra: dict[str, str],
    status: int,
    param: str | None,
) -> None:
    """Server-sent events carry each piece of audio as it comes, then speech.audio.done;
    a format it has not, or SSE of a WAV (whose header needs the length), is a 400."""
    pcm = b"\1\0" * 240
    audio = {"audio": base64.b64encode(pcm).decode(), "sample_rate": 24_000}
    # code2wav's last piece is empty and counts the codes; under SSE the thinker emits
    # too, its result counting the prompt's tokens.
    last = {"audio": "", "sample_rate": 24_000, "codes": 50}
    answer = {"text": "hi", "finish_reason": "stop", "prompt_tokens": 7, "completion_tokens": 1}

    def emit(body: SubmitRequest) -> Iterator[bytes]:
        thinker = "forced_reply" in body.params
        return results(answer)(body) if thinker else results(audio, audio, last)(body)

    worker = FakeWorker(emit)
    with router(tmp_path, serve_worker(worker), pipeline="omni") as client:
        body = {"model": "tiny-omni", "input": "hi", "response_format": "pcm", **extra}
        resp = client.post("/v1/audio/speech", json=body)
    assert resp.status_code == status, resp.text
    if param is not None:
        assert openai_error(resp)["param"] == param
    elif extra["stream_format"] == "sse":
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [
            json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ")
        ]
        assert [e["type"] for e in events] == ["speech.audio.delta"] * 2 + ["speech.audio.done"]
        assert b"".join(base64.b64decode(e["audio"]) for e in events[:2]) == pcm * 2
        usage = {"input_tokens": 7, "output_tokens": 50, "total_tokens": 57}
        assert events[-1]["usage"] == usage
    else:
        assert resp.content == pcm * 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("instructions", "whisper"),
        ("language", "English"),
        ("task_type", "Base"),
        ("ref_audio", "data:audio/wav;base64,UklGRg=="),
        ("ref_text", "hello"),
        ("x_vector_only_mode", True),
        ("initial_codec_chunk_frames", 4),
    ],
)
def test_a_speech_field_the_model_cannot_take_is_refused_by_name(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str], field: str, value: object
) -> None:
    """Qwen-Omni reads the input aloud in a preset voice: a style, a language or a clip to
    clone is a 400 naming the field, not speech made as if it had not been asked."""
    worker = FakeWorker(results())
    with router(tmp_path, serve_worker(worker), pipeline="omni") as client:
        resp = client.post(
            "/v1/audio/speech", json={"model": "tiny-omni", "input": "hi", field: value}
        )
    assert resp.status_code == 400, resp.text
    error = openai_error(resp)
    assert error["param"] == field
    assert f"does not take {field}" in error["message"]
    assert worker.submitted == []


def test_max_new_tokens_bounds_the_talkers_frames(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    audio = {"audio": base64.b64encode(b"\0\0").decode(), "sample_rate": 24_000}
    worker = FakeWorker(results(audio))
    with router(tmp_path, serve_worker(worker), pipeline="omni") as client:
        base = {"model": "tiny-omni", "input": "hi", "response_format": "pcm"}
        ok = client.post("/v1/audio/speech", json={**base, "max_new_tokens": 37})
        too_many = client.post("/v1/audio/speech", json={**base, "max_new_tokens": 10**6})
        zero = client.post("/v1/audio/speech", json={**base, "max_new_tokens": 0})
    assert ok.status_code == 200, ok.text
    # Each stage by the stage it reads from: the talker's input is the thinker.
    sampling = {tuple(body.inputs): body.params["sampling"] for body in worker.submitted}
    assert sampling == {(): None, ("thinker",): {"max_tokens": 37}, ("talker",): None}
    for refused in (too_many, zero):
        assert refused.status_code == 400, refused.text
        assert openai_error(refused)["param"] == "max_new_tokens"
