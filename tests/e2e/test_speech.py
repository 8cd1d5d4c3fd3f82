"""/v1/audio/speech on the tiny Qwen-Omni pipelines (each variant's serve, shared with
test_omni.py): WAV and streamed PCM, every response_format a client's decoder reads to
the right length, speed, server-sent events, and what is refused by name."""

from __future__ import annotations

import base64
import io
import json
import wave

import av
import httpx
import openai
import pytest

from tests.e2e.conftest import Served
from tests.e2e.omni_variants import MODEL, TALKER_CODES, Variant

pytestmark = pytest.mark.timeout(300)


def read_wav(data: bytes) -> tuple[int, int, int]:
    with wave.open(io.BytesIO(data)) as w:
        return w.getnchannels(), w.getframerate(), w.getnframes()


def test_speech_returns_wav(omni_client: openai.OpenAI, omni_variant: Variant) -> None:
    r = omni_client.audio.speech.create(model=MODEL, input="hello world", voice="Ethan")
    assert read_wav(r.content) == (1, 24000, omni_variant.samples(TALKER_CODES))


def test_speech_streams_pcm(omni_served: Served, omni_variant: Variant) -> None:
    body = {"model": MODEL, "input": "hello", "voice": "Chelsie", "response_format": "pcm"}
    arrivals: list[int] = []
    with httpx.stream("POST", f"{omni_served.base_url}/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["x-sample-rate"] == "24000"
        for part in r.iter_raw():
            arrivals.append(len(part))
    assert sum(arrivals) == omni_variant.samples(TALKER_CODES) * 2
    assert len(arrivals) >= 2  # sent chunk by chunk, not as one body


def test_speech_rejects_unknown_voice_and_format(omni_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="voices: Chelsie, Ethan"):
        omni_client.audio.speech.create(model=MODEL, input="hi", voice="alloy")
    with pytest.raises(openai.BadRequestError, match="response_format"):
        omni_client.audio.speech.create(
            model=MODEL,
            input="hi",
            voice="Ethan",
            response_format="ogg",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.BadRequestError, match="WAV's header needs its length"):
        omni_client.audio.speech.create(model=MODEL, input="hi", voice="Ethan", stream_format="sse")
    # Qwen-Omni reads aloud in a preset voice: a style to speak in is not something it takes.
    with pytest.raises(openai.BadRequestError, match="does not take instructions") as refused:
        omni_client.audio.speech.create(
            model=MODEL, input="hi", voice="Ethan", instructions="whisper it"
        )
    assert refused.value.body["param"] == "instructions"  # type: ignore[index]
    # Fewer codes than the talker's spec must make (minTokens: TALKER_CODES and more).
    with pytest.raises(openai.BadRequestError, match="min_tokens") as refused:
        omni_client.audio.speech.create(
            model=MODEL, input="hi", voice="Ethan", extra_body={"max_new_tokens": 10}
        )
    assert refused.value.body["param"] == "max_new_tokens"  # type: ignore[index]


def audio_seconds(data: bytes) -> float:
    """The length a client's decoder (PyAV) reads from a speech body."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return samples / stream.rate


def test_speech_in_every_format_and_at_another_speed(
    omni_client: openai.OpenAI, omni_variant: Variant
) -> None:
    seconds = omni_variant.samples(TALKER_CODES) / 24_000
    seeded = {"seed": 11}
    for fmt, codec in (("mp3", "mp3"), ("aac", "aac"), ("opus", "opus"), ("flac", "flac")):
        r = omni_client.audio.speech.create(
            model=MODEL, input="hello world", voice="Ethan", response_format=fmt, extra_body=seeded
        )
        with av.open(io.BytesIO(r.content)) as container:
            # The decoder's name: mp3float for MP3, libopus or opus for Opus.
            assert codec in container.streams.audio[0].codec_context.name, fmt
        # A codec pads its last frame, and AAC in ADTS keeps its encoder's 1024 samples of
        # priming (no header says to drop them): at most two frames, 96 ms at 24 kHz.
        assert audio_seconds(r.content) == pytest.approx(seconds, abs=0.1), fmt
    normal = omni_client.audio.speech.create(
        model=MODEL, input="hello world", voice="Ethan", response_format="pcm", extra_body=seeded
    )
    twice = omni_client.audio.speech.create(
        model=MODEL, input="hello world", voice="Ethan", response_format="pcm", speed=2.0,
        extra_body=seeded,
    )  # fmt: skip
    assert len(normal.content) == omni_variant.samples(TALKER_CODES) * 2
    assert len(twice.content) / len(normal.content) == pytest.approx(0.5, abs=0.02)


def test_speech_as_server_sent_events(omni_served: Served, omni_variant: Variant) -> None:
    body = {"model": MODEL, "input": "hello", "voice": "Ethan", "response_format": "pcm"}
    events = []
    with httpx.stream(
        "POST",
        f"{omni_served.base_url}/audio/speech",
        json={**body, "stream_format": "sse"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    deltas = [base64.b64decode(e["audio"]) for e in events[:-1]]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"}
    assert len(deltas) >= 2  # piece by piece
    assert sum(len(d) for d in deltas) == omni_variant.samples(TALKER_CODES) * 2
    # OpenAI's usage: the thinker's prompt (the chat template around "hello") in, and
    # the talker's codes out.
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == TALKER_CODES
    assert 1 < usage["input_tokens"] < 100
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
