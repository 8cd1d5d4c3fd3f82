"""Qwen2.5-Omni and Qwen3-Omni (tiny://qwen2.5-omni, tiny://qwen3-omni) through `omnipipe
serve`, driven by the official openai client: chat completions with text and audio,
streamed and not, speech, media inputs, per-stage sampling, cancellation and the audio
metrics. Every test runs against both models."""

from __future__ import annotations

import base64
import io
import threading
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.e2e.conftest import Served, rss_kib, start_serve
from tests.e2e.omni_variants import (
    AUDIO,
    HELLO,
    MODEL,
    TALKER_CODES,
    THINKER_TOKENS,
    Variant,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def variant(omni_variant: Variant) -> Variant:
    return omni_variant


@pytest.fixture
def served(omni_served: Served) -> Served:
    return omni_served


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
    yield c
    c.close()


def read_wav(data: bytes) -> tuple[int, int, int]:
    with wave.open(io.BytesIO(data)) as w:
        return w.getnchannels(), w.getframerate(), w.getnframes()


def png_data_url() -> str:
    buffer = io.BytesIO()
    Image.fromarray(np.arange(48 * 48 * 3, dtype=np.uint8).reshape(48, 48, 3)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def wav_b64(seconds: float = 0.5, rate: int = 16000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (np.sin(2 * np.pi * 440 * t) * 12000).astype("<i2").tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return base64.b64encode(buffer.getvalue()).decode()


def metric(served: Served, stage: str, name: str) -> float:
    return served.metric(f"{stage}-0", name)


def completions(served: Served, stage: str) -> float:
    return metric(served, stage, "omnipipe_stage_request_duration_seconds_count")


def test_chat_returns_text_and_a_wav(client: openai.OpenAI, variant: Variant) -> None:
    r = client.chat.completions.create(
        model=MODEL, modalities=["text", "audio"], audio=AUDIO, messages=HELLO
    )
    message = r.choices[0].message
    assert r.usage is not None
    assert r.usage.completion_tokens == THINKER_TOKENS
    assert r.choices[0].finish_reason == "length"
    assert message.audio is not None
    assert message.audio.transcript == message.content
    assert read_wav(base64.b64decode(message.audio.data)) == (
        1,
        24000,
        variant.samples(TALKER_CODES),
    )


def audio_stream(client: openai.OpenAI, **kw: Any) -> openai.Stream[Any]:
    """A streamed chat completion of HELLO with text and PCM audio."""
    return client.chat.completions.create(
        model=MODEL,
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"},
        messages=HELLO,
        stream=True,
        **kw,
    )


def stream_events(client: openai.OpenAI, **kw: Any) -> list[tuple[float, str, Any]]:
    """(seconds since the call, kind, payload) for each text delta, audio chunk, finish."""
    started = time.monotonic()
    events: list[tuple[float, str, Any]] = []
    stream = audio_stream(client, **kw)
    with stream:
        for chunk in stream:
            now = time.monotonic() - started
            choice = chunk.choices[0]
            if choice.delta.content:
                events.append((now, "text", choice.delta.content))
            audio = getattr(choice.delta, "audio", None)
            if audio is not None and audio.data:
                events.append((now, "audio", base64.b64decode(audio.data)))
            if choice.finish_reason:
                events.append((now, "finish", choice.finish_reason))
    return events


def test_the_voices_listing_names_the_speakers_of_the_checkpoint(served: Served) -> None:
    """GET /v1/audio/voices of an omni model: the speakers its thinker hands the talker,
    as the checkpoint spells them (Qwen3-Omni keys them in lower case; they are named
    capitalised, as requests name them)."""
    listed = httpx.get(f"{served.base_url}/audio/voices", timeout=30).json()
    assert sorted(listed["voices"]) == ["Chelsie", "Ethan"]
    assert all(v["preset"] for v in listed["data"])


def test_stream_sends_text_first_and_audio_last(client: openai.OpenAI, variant: Variant) -> None:
    events = stream_events(client)
    kinds = [kind for _, kind, _ in events]
    audio = [payload for _, kind, payload in events if kind == "audio"]
    assert "text" in kinds, kinds
    assert len(audio) == 3, kinds  # 25 + 25 + 10 codes
    assert all(np.frombuffer(a, "<i2").any() for a in audio), "silent audio chunk"
    assert kinds.index("text") < kinds.index("audio")
    last_text = len(kinds) - 1 - kinds[::-1].index("text")
    assert last_text < len(kinds) - 1 - kinds[::-1].index("audio")
    assert kinds[-1] == "finish"
    assert events[-1][2] == "length"
    assert sum(len(a) for a in audio) == variant.samples(TALKER_CODES) * 2  # s16le
    first_audio = next(t for t, kind, _ in events if kind == "audio")
    assert first_audio < events[-1][0]


# A thinker reply that takes ~25 s alone, against a first audio of under a second alone
# and ~2 s on two loaded cores: the talker and code2wav must stream to be heard before it
# ends, whatever the load. (300 tokens, ~2 s, lost that race under pytest-xdist's load.)
LONG_REPLY = {"max_tokens": 4000, "min_tokens": 4000}
STAGES = ("thinker", "talker", "code2wav")


def stage_load(served: Served) -> list[float]:
    """Requests each of STAGES runs or holds waiting."""
    return [
        metric(served, s, "omnipipe_stage_requests_running")
        + metric(served, s, "omnipipe_stage_requests_waiting")
        for s in STAGES
    ]


def wait_idle(served: Served, timeout: float = 10) -> list[float]:
    """stage_load once every stage is idle, or as it stands after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (load := stage_load(served)) != [0, 0, 0] and time.monotonic() < deadline:
        time.sleep(0.1)
    return load


def runs(kinds: list[str]) -> str:
    """'text x27, audio x1, text x1': what a stream sent, in order, without 4000 entries."""
    counted: list[list[Any]] = []
    for kind in kinds:
        if counted and counted[-1][0] == kind:
            counted[-1][1] += 1
        else:
            counted.append([kind, 1])
    return ", ".join(f"{kind} x{n}" for kind, n in counted)


def test_talker_and_code2wav_start_before_the_thinker_ends(
    served: Served, client: openai.OpenAI
) -> None:
    """The first 25 codes need only the first ~26 of the thinker's tokens: when the stages
    stream to each other, audio reaches the client while the text is still coming. The
    client reads until text follows audio (the router relays events in the order they
    reach it), then cancels the rest of the reply."""
    kinds: list[str] = []
    with audio_stream(client, extra_body={"sampling_params_list": [LONG_REPLY]}) as stream:
        for chunk in stream:
            choice = chunk.choices[0]
            # Text first: text sent with the audio in one chunk is not text after it.
            if choice.delta.content:
                kinds.append("text")
            audio = getattr(choice.delta, "audio", None)
            if audio is not None and audio.data:
                kinds.append("audio")
            if choice.finish_reason:
                kinds.append("finish")
            if "audio" in kinds and kinds[-1] == "text":
                break  # the thinker was still making text after code2wav's first audio
    assert "audio" in kinds, runs(kinds)
    assert "text" in kinds[kinds.index("audio") :], runs(kinds)
    assert wait_idle(served) == [0, 0, 0], "the stages still hold the cancelled request"


def handed_on(served: Served, stage: str) -> tuple[float, float]:
    """(hand-offs, transport messages) the stage has sent downstream so far."""
    counts = {
        "omnipipe_transfer_duration_seconds_count": 0.0,
        "omnipipe_transfer_frames_total": 0.0,
    }
    for line in served.metrics(f"{stage}-0").splitlines():
        name, _, rest = line.partition("{")
        if name in counts and 'direction="out"' in rest:
            counts[name] += float(line.rsplit(" ", 1)[1])
    return counts["omnipipe_transfer_duration_seconds_count"], counts[
        "omnipipe_transfer_frames_total"
    ]


def test_concurrent_spoken_chats_hand_on_one_message_per_step_not_per_token(
    served: Served, variant: Variant
) -> None:
    """Issue #25: 16 spoken chats at once. The thinker streams each chat's tokens to the
    talker as it makes them; the chunks of every chat one step made leave in one
    transport message, so it sends fewer messages than chunks x requests, and every
    chat still comes back whole."""
    requests = 16
    before = handed_on(served, "thinker")
    replies: list[Any] = []
    errors: list[BaseException] = []

    def chat() -> None:
        c = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
        try:
            replies.append(
                c.chat.completions.create(
                    model=MODEL, modalities=["text", "audio"], audio=AUDIO, messages=HELLO
                )
            )
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=chat) for _ in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert errors == []
    wavs = [read_wav(base64.b64decode(r.choices[0].message.audio.data)) for r in replies]
    assert wavs == [(1, 24000, variant.samples(TALKER_CODES))] * requests
    after = handed_on(served, "thinker")
    hand_offs, frames = after[0] - before[0], after[1] - before[1]
    print(f"{variant.model} thinker: {hand_offs:.0f} hand-offs in {frames:.0f} messages")
    assert hand_offs > requests  # each chat's tokens went on as it made them, in chunks
    assert frames < hand_offs, f"{frames} messages for {hand_offs} hand-offs of {requests} chats"


def test_image_and_audio_inputs_reach_the_processor(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=HELLO)
    media = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hello"},
                    {"type": "image_url", "image_url": {"url": png_data_url()}},
                    {"type": "input_audio", "input_audio": {"data": wav_b64(), "format": "wav"}},
                ],
            }
        ],
    )
    assert plain.usage is not None
    assert media.usage is not None
    # The processor expands each image and clip into its placeholder tokens.
    assert media.usage.prompt_tokens > plain.usage.prompt_tokens + 4
    assert media.usage.completion_tokens == THINKER_TOKENS


def bad_part(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]


GARBAGE = base64.b64encode(b"this is not media at all").decode()


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{GARBAGE}"}},
            "not a decodable image",
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}},
            "not valid base64",
        ),
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            "data: URL",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": GARBAGE, "format": "wav"}},
            "not a decodable WAV",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": wav_b64(), "format": "mp3"}},
            "only wav",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_malformed_media_is_a_400(
    client: openai.OpenAI, part: dict[str, Any], message: str, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model=MODEL, messages=bad_part(part), stream=stream)


def one_colour_png(side: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (30, 90, 200)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_media_past_the_request_budget_decodes_nothing_and_others_go_on(
    served: Served, client: openai.OpenAI
) -> None:
    """Six 8000x8000 PNGs (1.1 GB decoded) and two hundred 1 Hz clips (each resampled to
    16,000 floats a byte) are refused from their headers: the thinker's memory hardly
    moves, and a chat sent beside them is answered."""
    pid = served.workers["thinker-0"][1]
    big = one_colour_png(8000)
    clip = wav_b64(seconds=300, rate=1)
    before = rss_kib(pid)
    answered: list[Any] = []
    beside = threading.Thread(
        target=lambda: answered.append(client.chat.completions.create(model=MODEL, messages=HELLO))
    )
    beside.start()
    started = time.monotonic()
    images = [{"type": "image_url", "image_url": {"url": big}}] * 6
    with pytest.raises(openai.BadRequestError, match="64000000 pixels in all") as refused:
        client.chat.completions.create(model=MODEL, messages=bad_part(*images))
    assert refused.value.body["param"] == "messages[0].content[2]"  # type: ignore[index]
    clips = [{"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}] * 200
    with pytest.raises(openai.BadRequestError, match="sample rate 1 Hz is outside 8000"):
        client.chat.completions.create(model=MODEL, messages=bad_part(*clips))
    took = time.monotonic() - started
    beside.join(timeout=120)
    grown_mib = (rss_kib(pid) - before) / 1024
    assert answered, "the chat sent beside them was not answered"
    assert took < 10, f"the refusals took {took:.1f} s"
    assert grown_mib < 100, f"the thinker grew {grown_mib:.0f} MiB"


def test_the_thinker_derives_its_media_limits_from_its_processor(
    served: Served, client: openai.OpenAI, variant: Variant
) -> None:
    """tiny://qwen2.5-omni's Whisper extractor keeps 30 s of a clip: a longer one is a 400
    naming the limit and its source. Qwen3-Omni's keeps the whole clip and answers it."""
    logged = [line for line in served.output if "media limits: maxImages" in line]
    assert len(logged) == 1, logged  # once, at the thinker's load
    clip = {"type": "input_audio", "input_audio": {"data": wav_b64(seconds=31), "format": "wav"}}
    if variant.pipeline == "qwen3-omni":
        assert "maxAudioClipSeconds 300 (default)" in logged[0]
        r = client.chat.completions.create(model=MODEL, messages=bad_part(clip))
        assert r.usage is not None
        assert r.usage.prompt_tokens > 31 * 13
        return
    assert "maxAudioClipSeconds 30 (processor)" in logged[0]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=bad_part(clip))
    assert refused.value.body["message"] == (  # type: ignore[index]
        "messages[0].content[1]: the clip is 31.0s, past the limit of 30s a clip "
        "(maxAudioClipSeconds, from the model's processor: it keeps only the first 30s of a "
        "clip)"
    )
    assert refused.value.body["param"] == "messages[0].content[1]"  # type: ignore[index]


def test_a_megabyte_message_is_a_400_that_names_the_context(
    served: Served, client: openai.OpenAI
) -> None:
    """Refused before it occupies the thinker: the engine is free at once for the next."""
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * 1_000_000}]
        )
    assert time.monotonic() - started < 60
    assert served.metric("thinker-0", "omnipipe_stage_requests_running") == 0
    short = {"max_tokens": 3, "min_tokens": 3}
    r = client.chat.completions.create(
        model=MODEL, messages=HELLO, extra_body={"sampling_params_list": [short]}
    )
    assert r.usage is not None
    assert r.usage.completion_tokens == 3


def test_sampling_params_per_stage(client: openai.OpenAI, variant: Variant) -> None:
    short = {"max_tokens": 3, "min_tokens": 3}
    for form in ([short], {"thinker": short}):
        r = client.chat.completions.create(
            model=MODEL, messages=HELLO, extra_body={"sampling_params_list": form}
        )
        assert r.usage is not None
        assert r.usage.completion_tokens == 3
    ten = variant.talker_tokens(10)
    r = client.chat.completions.create(
        model=MODEL,
        modalities=["text", "audio"],
        audio=AUDIO,
        messages=HELLO,
        extra_body={"sampling_params_list": {"talker": {"max_tokens": ten, "min_tokens": ten}}},
    )
    assert r.choices[0].message.audio is not None
    assert read_wav(base64.b64decode(r.choices[0].message.audio.data))[2] == variant.samples(10)
    for bad, match in (
        ({"thinker": {"bogus": 1}}, "bogus"),
        ({"nope": {"max_tokens": 1}}, "no stage 'nope'"),
        ([{}, {}, {}, {}], "4 entries"),
    ):
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(
                model=MODEL, messages=HELLO, extra_body={"sampling_params_list": bad}
            )


def test_seed_makes_text_and_audio_reproducible(client: openai.OpenAI) -> None:
    def run(seed: int) -> tuple[str | None, str]:
        r = client.chat.completions.create(
            model=MODEL, modalities=["text", "audio"], audio=AUDIO, messages=HELLO, seed=seed
        )
        assert r.choices[0].message.audio is not None
        return r.choices[0].message.content, r.choices[0].message.audio.data

    first = run(7)
    assert run(7) == first
    assert run(8) != first


def test_text_only_runs_only_the_thinker(served: Served, client: openai.OpenAI) -> None:
    before = {s: completions(served, s) for s in ("thinker", "talker", "code2wav")}
    r = client.chat.completions.create(model=MODEL, messages=HELLO)
    assert r.choices[0].message.audio is None
    after = {s: completions(served, s) for s in ("thinker", "talker", "code2wav")}
    assert after["thinker"] == before["thinker"] + 1
    assert (after["talker"], after["code2wav"]) == (before["talker"], before["code2wav"])


def test_audio_metrics(served: Served, client: openai.OpenAI) -> None:
    ttfa, rtf = (
        "omnipipe_stage_time_to_first_audio_seconds_count",
        "omnipipe_stage_real_time_factor_count",
    )
    before = {s: (metric(served, s, ttfa), metric(served, s, rtf)) for s in ("talker", "code2wav")}
    client.chat.completions.create(
        model=MODEL, modalities=["text", "audio"], audio=AUDIO, messages=HELLO
    )
    for stage in ("talker", "code2wav"):
        assert metric(served, stage, ttfa) == before[stage][0] + 1
        assert metric(served, stage, rtf) == before[stage][1] + 1
    assert metric(served, "thinker", ttfa) == 0  # the thinker makes no audio


def test_cancelling_mid_stream_frees_every_stage(served: Served, client: openai.OpenAI) -> None:
    done_before = {s: completions(served, s) for s in STAGES}
    stream = audio_stream(client, extra_body={"sampling_params_list": [LONG_REPLY, LONG_REPLY]})
    for chunk in stream:
        audio = getattr(chunk.choices[0].delta, "audio", None)
        if audio is not None and audio.data:
            break  # every stage is busy now
    assert all(metric(served, s, "omnipipe_stage_requests_running") == 1 for s in STAGES), (
        "expected all three stages to hold the request"
    )
    stream.close()
    load = wait_idle(served)
    assert load == [0, 0, 0], f"stages still hold the cancelled request: {load}"
    # Aborted, not finished: no stage recorded a completed request.
    assert {s: completions(served, s) for s in STAGES} == done_before


TEXT_ONLY = """apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: tiny-chat}
spec:
  model: tiny://qwen2.5-omni
  pipeline: custom
  transfer: {backend: tcp}
  stages:
    - {name: llm, role: thinker, engine: transformers, sampling: {maxTokens: 5, minTokens: 5}}
"""


def test_a_text_only_pipeline_serves_chat(tmp_module: Path) -> None:
    manifest = tmp_module / "tiny-chat.yaml"
    manifest.write_text(TEXT_ONLY)
    s = start_serve(manifest)
    c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
    try:
        # Seeded: unseeded, 5 random tokens of a byte-level vocabulary are sometimes all
        # special or partial UTF-8 and show no text at all.
        stream = c.chat.completions.create(model="tiny-chat", messages=HELLO, stream=True, seed=3)
        deltas = [
            chunk.choices[0].delta.content
            for chunk in stream
            if chunk.choices and chunk.choices[0].delta.content
        ]
        whole = c.chat.completions.create(model="tiny-chat", messages=HELLO, seed=3)
        assert whole.usage is not None
        assert whole.usage.completion_tokens == 5
        assert whole.choices[0].message.content
        assert "".join(deltas) == whole.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="no audio output stage"):
            c.chat.completions.create(
                model="tiny-chat", modalities=["text", "audio"], audio=AUDIO, messages=HELLO
            )
        with pytest.raises(openai.BadRequestError, match="does not produce speech"):
            c.audio.speech.create(model="tiny-chat", input="hi", voice="Ethan")
    finally:
        c.close()
        s.stop()
    assert s.proc.returncode == 0
