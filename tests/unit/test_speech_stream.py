"""WS /v1/audio/speech/stream against fake stage workers (tests/unit/test_router_results.py):
text written in pieces is spoken a sentence at a time, in order and with one seed; an
utterance ends with session.done and the connection stays; input.cancel stops the stages;
what is wrong gets an error event that names it and ends nothing else; the API key guards
the handshake. The sentence splitter on its own first."""

from __future__ import annotations

import base64
import io
import json
import time
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from omnipipe.api.wire import StageEvent, SubmitRequest, event_lines
from omnipipe.router.api.sentences import SentenceSplitter
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings
from tests.unit import test_router_results
from tests.unit.test_router_results import FakeWorker, results
from tests.unit.test_router_voices import tts

pytestmark = pytest.mark.timeout(60)
serve_worker = test_router_results.serve_worker
PCM = b"\x01\x00" * 2400  # 0.1 s at 24 kHz
AUDIO = {"audio": base64.b64encode(PCM).decode(), "sample_rate": 24000}
CONFIG = {"type": "session.config", "model": "tts", "voice": "vivian", "response_format": "pcm"}


def test_the_splitter_gives_each_sentence_once_it_is_complete() -> None:
    s = SentenceSplitter()
    assert s.feed("The train lea") == []
    assert s.feed("ves at noon. It is 3.5 km") == ["The train leaves at noon."]
    # A closing quote stays with its sentence.
    assert s.feed(' away! "Really?" she asked.\nYes') == [
        "It is 3.5 km away!",
        '"Really?"',
        "she asked.",
    ]
    assert s.feed("。") == ["Yes。"]  # a full-width stop needs no space after it
    assert s.flush() == []
    assert SentenceSplitter().feed("你好。今天") == ["你好。"]
    rest = SentenceSplitter()
    rest.feed("no end yet")
    assert rest.flush() == ["no end yet"]


def test_abbreviations_and_initials_do_not_end_a_sentence() -> None:
    s = SentenceSplitter()
    assert s.feed("Dr. Smith met J. R. R. Tolkien in the U.S. on Jan. 3, e.g. at noon. ") == [
        "Dr. Smith met J. R. R. Tolkien in the U.S. on Jan. 3, e.g. at noon."
    ]
    assert s.feed("Bring a pen, paper, etc. and a coat. Yes! ") == [
        "Bring a pen, paper, etc. and a coat.",
        "Yes!",
    ]
    # A word that is no abbreviation still ends its sentence at its period.
    assert s.feed("I said no. Then I left. ") == ["I said no.", "Then I left."]
    # Periods of initials past the limit do not hold a long text back.
    held = SentenceSplitter(max_chars=40)
    assert held.feed("a. " * 30) != []


def test_a_long_sentence_is_spoken_a_clause_at_a_time() -> None:
    s = SentenceSplitter(max_chars=40)
    pieces = s.feed("one two three four five, six seven eight nine ten eleven twelve")
    assert pieces == ["one two three four five,"]
    assert s.feed(" thirteen fourteen") == ["six seven eight nine ten eleven twelve"]
    assert s.feed("x" * 100) != []  # one word longer than the limit is cut where it must be
    assert all(len(p) <= 40 for p in [*pieces, *s.feed("y" * 100)])


@pytest.fixture
def router(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str], request: pytest.FixtureRequest
) -> Iterator[tuple[TestClient, FakeWorker]]:
    worker: FakeWorker = getattr(request, "param", None) or FakeWorker(results(AUDIO))
    url = serve_worker(worker)
    replicas = tmp_path / "replicas.json"
    pipeline = tts("tiny://qwen3-tts-custom-voice")
    replicas.write_text(json.dumps({s.name: [url] for s in pipeline.stages}))
    config = RouterSettings(replicas_file=str(replicas), api_key="k")
    with TestClient(build_app(pipeline, config)) as client:
        yield client, worker


KEY = {"Authorization": "Bearer k"}


def events_until(ws: Any, kind: str) -> list[Any]:
    """Messages (JSON as dicts, audio as bytes) up to and with the first of `kind`."""
    seen: list[Any] = []
    while True:
        message = ws.receive()
        assert message["type"] == "websocket.send", message
        seen.append(json.loads(message["text"]) if message.get("text") else message["bytes"])
        if isinstance(seen[-1], dict) and seen[-1]["type"] == kind:
            return seen


def test_three_sentences_written_in_pieces_are_spoken_in_order_with_one_seed(
    router: tuple[TestClient, FakeWorker],
) -> None:
    client, worker = router
    with client.websocket_connect("/v1/audio/speech/stream", headers=KEY) as ws:
        ws.send_json(CONFIG)
        for piece in ["The train ", "leaves at noon. Bring", " a coat! Is it", " cold?"]:
            ws.send_json({"type": "input.text", "text": piece})
        ws.send_json({"type": "input.done"})
        seen = events_until(ws, "session.done")
        ws.send_json({**CONFIG, "response_format": "wav"})  # a new config between utterances
        ws.send_json({"type": "input.text", "text": "Again."})
        ws.send_json({"type": "input.done"})
        again = events_until(ws, "session.done")
        ws.send_json({"type": "session.close"})
    texts = ["The train leaves at noon.", "Bring a coat!", "Is it cold?"]
    expected: list[Any] = []
    for i, text in enumerate(texts):
        where = {"utterance_index": 0, "sentence_index": i}
        expected += [
            {"type": "audio.start", **where, "sentence_text": text, "format": "pcm"}
            | {"sample_rate": 24000},
            PCM,
            {"type": "audio.done", **where, "total_bytes": len(PCM), "error": False}
            | {"cancelled": False},
        ]
    done = {"type": "session.done", "utterance_index": 0, "total_sentences": 3}
    assert seen == [*expected, done | {"cancelled": False}]
    with wave.open(io.BytesIO(again[1])) as w:
        assert (w.getframerate(), w.readframes(w.getnframes())) == (24000, PCM)
    assert again[-1]["utterance_index"] == 1
    talker = [s for s in worker.submitted if "input" in s.params]
    assert [s.params["input"] for s in talker] == [*texts, "Again."]
    assert len({s.params["seed"] for s in talker}) == 1  # one voice, not one per sentence


def test_stream_audio_sends_the_pieces_as_they_are_made(
    router: tuple[TestClient, FakeWorker],
) -> None:
    client, worker = router
    worker.emit = results(AUDIO, AUDIO)
    with client.websocket_connect("/v1/audio/speech/stream", headers=KEY) as ws:
        ws.send_json({**CONFIG, "stream_audio": True})
        ws.send_json({"type": "input.text", "text": "One."})
        ws.send_json({"type": "input.done"})
        seen = events_until(ws, "session.done")
    assert [m if isinstance(m, bytes) else m["type"] for m in seen] == [
        "audio.start",
        PCM,
        PCM,
        "audio.done",
        "session.done",
    ]
    assert seen[3]["total_bytes"] == 2 * len(PCM)


def slow_first() -> Callable[[SubmitRequest], Iterator[bytes]]:
    """The first request's audio a tenth of a second apart, for ten seconds (long enough
    to be cancelled); the later ones' at once."""
    calls: list[str] = []

    def emit(body: SubmitRequest) -> Iterator[bytes]:
        calls.append(body.request_id)
        for i in range(100 if len(calls) == 1 else 1):
            yield from event_lines(StageEvent(type="result", index=i, data=AUDIO))
            time.sleep(0.1)
        yield StageEvent(type="done").model_dump_json().encode() + b"\n"

    return emit


@pytest.mark.parametrize("router", [FakeWorker(slow_first())], indirect=True)
def test_cancel_stops_the_stages_and_drops_what_waits(
    router: tuple[TestClient, FakeWorker],
) -> None:
    client, worker = router
    with client.websocket_connect("/v1/audio/speech/stream", headers=KEY) as ws:
        ws.send_json({**CONFIG, "stream_audio": True})
        ws.send_json({"type": "input.text", "text": "A long one. A second. A third "})
        assert ws.receive_json()["type"] == "audio.start"
        assert ws.receive_bytes() == PCM
        ws.send_json({"type": "input.cancel"})
        seen = events_until(ws, "session.done")
        ws.send_json({"type": "input.text", "text": "After. "})
        after = events_until(ws, "audio.done")
    done = seen[-1]
    assert done == {
        "type": "session.done",
        "utterance_index": 0,
        "total_sentences": 2,
        "cancelled": True,
    }
    # The stopped sentence's audio ends with its audio.done, marked so, before the end.
    stopped = seen[-2]
    assert stopped["type"] == "audio.done"
    assert (stopped["sentence_index"], stopped["cancelled"], stopped["error"]) == (0, True, False)
    audio = b"".join(m for m in seen[:-2] if isinstance(m, bytes))
    assert stopped["total_bytes"] == len(PCM) + len(audio)  # what was sent, the first too
    assert all(isinstance(m, bytes) for m in seen[:-2])
    assert after[0]["sentence_text"] == "After."
    assert after[0]["utterance_index"] == 1
    first = worker.submitted[0].request_id
    deadline = time.monotonic() + 5
    while first not in worker.cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first in worker.cancelled
    spoken = {s.params.get("input") for s in worker.submitted}
    assert "A second." not in spoken


@pytest.mark.parametrize(
    ("message", "param", "says"),
    [
        ({"type": "input.text", "text": "Hi."}, "type", "send session.config before"),
        ({"type": "speak"}, "type", 'unknown message type "speak"'),
        ({**CONFIG, "speed": 9}, "speed", "speed: Input should be less than or equal to 4"),
        ({**CONFIG, "model": "other"}, "model", "model 'other' does not exist"),
        ({**CONFIG, "stream_audio": True, "response_format": "wav"}, "response_format", "WAV"),
        ({**CONFIG, "stream_audio": "yes"}, "stream_audio", "true or false"),
        ({**CONFIG, "input": "Hi."}, "input", "input is not a session field"),
        ({**CONFIG, "max_new_tokens": 0}, "max_new_tokens", "greater than or equal to 1"),
    ],
)
def test_what_is_wrong_is_named_and_the_session_goes_on(
    router: tuple[TestClient, FakeWorker], message: dict[str, Any], param: str, says: str
) -> None:
    client, _ = router
    with client.websocket_connect("/v1/audio/speech/stream", headers=KEY) as ws:
        ws.send_json(message)
        error = ws.receive_json()
        assert error["type"] == "error"
        assert error["error"]["param"] == param
        assert error["error"]["type"] == "invalid_request_error"
        assert says in error["message"] == error["error"]["message"]
        ws.send_bytes(b"\x00")
        assert "binary frame" in ws.receive_json()["message"]
        ws.send_text("{not json")
        assert ws.receive_json()["message"] == "a message is not JSON"
        ws.send_json(CONFIG)  # still open, and now configured
        ws.send_json({"type": "input.text", "text": "Fine. "})
        assert events_until(ws, "audio.done")[-1]["error"] is False


def test_text_buffered_keeps_its_config(router: tuple[TestClient, FakeWorker]) -> None:
    client, _ = router
    with client.websocket_connect("/v1/audio/speech/stream", headers=KEY) as ws:
        ws.send_json(CONFIG)
        ws.send_json({"type": "input.text", "text": "half a sen"})
        ws.send_json({**CONFIG, "voice": "ryan"})
        assert "while text is buffered" in ws.receive_json()["message"]


def test_the_handshake_needs_the_api_key(router: tuple[TestClient, FakeWorker]) -> None:
    client, worker = router
    for headers in [{}, {"Authorization": "Bearer wrong"}]:
        # Closed before it is accepted: over the wire, an HTTP 403 to the handshake.
        with (
            pytest.raises(WebSocketDisconnect) as closed,
            client.websocket_connect("/v1/audio/speech/stream", headers=headers) as ws,
        ):
            ws.receive_json()
        assert closed.value.code == 1008
    assert worker.submitted == []


@pytest.mark.parametrize(
    "router", [FakeWorker(results(AUDIO), voices=["Vivian", "Ryan"])], indirect=True
)
def test_a_voice_the_model_lacks_is_refused_at_session_config(
    router: tuple[TestClient, FakeWorker],
) -> None:
    """Refused once, when configured, not by every sentence's talker; the presets match
    whatever their case, as the talker matches them."""
    client, worker = router
    with client.websocket_connect("/v1/audio/speech/stream", headers=KEY) as ws:
        ws.send_json({**CONFIG, "voice": "alloy"})
        refused = ws.receive_json()
        assert refused["error"]["param"] == "voice"
        assert "(Vivian, Ryan)" in refused["message"]
        ws.send_json({"type": "input.text", "text": "Hi. "})
        assert ws.receive_json()["error"]["message"] == "send session.config before input.text"
        ws.send_json({**CONFIG, "voice": "ryan"})
        ws.send_json({"type": "input.text", "text": "Hi. "})
        assert ws.receive_json()["type"] == "audio.start"
        events_until(ws, "audio.done")  # spoken whole before the session ends
        ws.send_json({"type": "session.close"})
    assert [s.params["voice"] for s in worker.submitted if "input" in s.params] == ["ryan"]


@pytest.mark.parametrize("router", [FakeWorker(slow_first())], indirect=True)
def test_a_client_that_writes_far_ahead_of_speech_is_told_and_bounded(
    router: tuple[TestClient, FakeWorker],
) -> None:
    client, worker = router
    with client.websocket_connect("/v1/audio/speech/stream", headers=KEY) as ws:
        ws.send_json(CONFIG)
        ws.send_json({"type": "input.text", "text": "x" * 4097})
        too_long = ws.receive_json()
        assert too_long["error"]["param"] == "text"
        assert "at most 4096 characters" in too_long["message"]
        # The first sentence is spoken slowly; 300 more cannot all wait behind it.
        ws.send_json({"type": "input.text", "text": "Go. " * 301})
        seen = events_until(ws, "error")
        assert "256 sentences and utterance ends already wait" in seen[-1]["message"]
        ws.send_json({"type": "input.cancel"})
        events_until(ws, "session.done")
    inputs = [s.params["input"] for s in worker.submitted if "input" in s.params]
    assert len(inputs) <= 2  # the slow one, and at most the next before the cancel


@pytest.mark.parametrize("router", [FakeWorker(slow_first())], indirect=True)
def test_cancel_ends_every_utterance_it_drops_and_never_waits(
    router: tuple[TestClient, FakeWorker],
) -> None:
    """Utterance 0 ended (input.done) but not yet spoken, utterance 1 being written: a
    cancel stops both, and each gets its session.done, cancelled, in order."""
    client, _ = router
    with client.websocket_connect("/v1/audio/speech/stream", headers=KEY) as ws:
        ws.send_json({**CONFIG, "stream_audio": True})
        ws.send_json({"type": "input.text", "text": "First one. Second one. Third one."})
        ws.send_json({"type": "input.done"})
        ws.send_json({"type": "input.text", "text": "Next utterance"})
        assert ws.receive_json()["type"] == "audio.start"
        ws.send_json({"type": "input.cancel"})
        ws.send_json({"type": "input.cancel"})  # a second, at once: nothing left but itself
        seen = [m for m in events_until(ws, "session.done") if isinstance(m, dict)]
        seen += [events_until(ws, "session.done")[-1], events_until(ws, "session.done")[-1]]
    assert seen[0]["type"] == "audio.done"
    assert seen[0]["cancelled"] is True
    ends = [(e["utterance_index"], e["total_sentences"], e["cancelled"]) for e in seen[1:]]
    assert ends == [(0, 3, True), (1, 0, True), (2, 0, True)]


def test_a_hostile_message_costs_little_and_is_named(
    router: tuple[TestClient, FakeWorker],
) -> None:
    client, _ = router
    with client.websocket_connect("/v1/audio/speech/stream", headers=KEY) as ws:
        ws.send_text("[" * 100_000 + "]" * 100_000)  # past the parser's depth
        assert ws.receive_json()["message"] == "a message is not JSON"
        ws.send_text('{"type": "x", "a": [' + "0," * 100_001 + "0]}")
        assert "100000 commas and colons" in ws.receive_json()["message"]
        ws.send_json(CONFIG)
        started = time.process_time()
        for _ in range(5):  # runs of stops with no space after them: one pass each
            ws.send_json({"type": "input.text", "text": "." * 4096})
        ws.send_json({"type": "input.cancel"})
        events_until(ws, "session.done")
        # Was 1.2 to 1.6 s of CPU a message in the sentence splitter alone.
        assert time.process_time() - started < 2.0
