"""`omnipipe serve tiny://qwen3-tts-custom-voice`: the openai client's speech is the
audio qwen-tts's own generate_custom_voice makes for the seed (within one 16-bit step),
in WAV, MP3 and as server-sent events with OpenAI's usage; what the model cannot speak
is refused by name. `omnipipe serve tiny://qwen3-tts-base`: the voice of a reference clip
sent with the request (from its x-vector, and in context with its transcript) is
generate_voice_clone's, and so is that of the same clip uploaded
once as a voice and named."""

from __future__ import annotations

import base64
import io
import json
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import av
import httpx
import numpy as np
import openai
import pytest
import websockets.sync.client

from omnipipe.client import Omni, OmniError
from tests.e2e.conftest import Served, start_serve, stop_cleanly
from tests.harness.tts_reference import pcm_of, reference_outputs
from tests.harness.voice_clips import clip

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny://qwen3-tts-custom-voice"
TEXT = "The train leaves at noon."
SPOKEN = {"seed": 42, "language": "english", "max_new_tokens": 30}
SAMPLES_PER_FRAME = 1920


def on_transformers(directory: Path, model: str) -> Path:
    """`model`'s pipeline with its talker on transformers, whose seeded speech is
    qwen-tts's own (vLLM, the default, draws its first codes with its own generator)."""
    manifest = directory / "tts-transformers.yaml"
    manifest.write_text(
        f"""apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {{name: {model.removeprefix("tiny://")}}}
spec:
  model: {model}
  pipeline: qwen3-tts
  stages:
  - name: talker
    engine: transformers
"""
    )
    return manifest


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    serve = start_serve(on_transformers(tmp_path_factory.mktemp("tts"), MODEL))
    try:
        yield serve
    finally:
        stop_cleanly(serve)


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    case = {
        "text": TEXT,
        "speaker": "vivian",
        "language": "english",
        "seed": SPOKEN["seed"],
        "max_new_tokens": SPOKEN["max_new_tokens"],
    }
    return reference_outputs({"served": ("qwen3-tts-custom-voice", case)})["served"]


def samples_of(wav_bytes: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(wav_bytes)) as w:
        assert (w.getnchannels(), w.getframerate(), w.getsampwidth()) == (1, 24000, 2)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def test_the_served_speech_is_qwen_tts_own_for_the_seed(
    client: openai.OpenAI, expected: dict[str, np.ndarray]
) -> None:
    r = client.audio.speech.create(model=MODEL, input=TEXT, voice="Vivian", extra_body=SPOKEN)
    pcm = samples_of(r.content)
    assert len(pcm) == len(expected["codes"]) * SAMPLES_PER_FRAME == len(expected["wav"])
    assert np.abs(pcm.astype(np.float64) - pcm_of(expected["wav"])).max() <= 1
    assert np.abs(pcm).max() > 10  # speech, not silence


def test_mp3_and_server_sent_events_with_usage(
    client: openai.OpenAI, served: Served, expected: dict[str, np.ndarray]
) -> None:
    frames = len(expected["codes"])
    mp3 = client.audio.speech.create(
        model=MODEL, input=TEXT, voice="Vivian", response_format="mp3", extra_body=SPOKEN
    )
    with av.open(io.BytesIO(mp3.content)) as container:
        stream = container.streams.audio[0]
        assert "mp3" in stream.codec_context.name
        seconds = sum(f.samples for f in container.decode(stream)) / stream.rate
    assert seconds == pytest.approx(frames * SAMPLES_PER_FRAME / 24000, abs=0.1)
    body = {"model": MODEL, "input": TEXT, "voice": "vivian", "response_format": "pcm"}
    with httpx.stream(
        "POST",
        f"{served.base_url}/audio/speech",
        json={**body, **SPOKEN, "stream_format": "sse"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(pcm) == frames * SAMPLES_PER_FRAME * 2
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == frames
    # The talker's prompt: the assistant turn around the text, byte by byte here.
    assert len(TEXT.encode()) < usage["input_tokens"] < 100
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_text_written_in_pieces_is_spoken_a_sentence_at_a_time_over_a_websocket(
    client: openai.OpenAI, served: Served, expected: dict[str, np.ndarray]
) -> None:
    """WS /v1/audio/speech/stream: three sentences sent seven characters at a time come
    back as three sentences of audio, in order; the first is qwen-tts's own for the seed,
    and each is what /v1/audio/speech says for that sentence alone."""
    sentences = [TEXT, "Bring a coat!", "Is it cold?"]
    text = " ".join(sentences)
    url = served.base_url.replace("http://", "ws://", 1) + "/audio/speech/stream"
    config = {"model": MODEL, "voice": "vivian", "response_format": "pcm", **SPOKEN}
    audio: dict[int, bytearray] = {}
    spoken: list[str] = []
    with websockets.sync.client.connect(url, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "session.config", "stream_audio": True, **config}))
        for i in range(0, len(text), 7):
            ws.send(json.dumps({"type": "input.text", "text": text[i : i + 7]}))
        ws.send(json.dumps({"type": "input.done"}))
        current = -1
        while True:
            message = ws.recv(timeout=120)
            if isinstance(message, bytes):
                audio[current].extend(message)
                continue
            event = json.loads(message)
            assert event["type"] != "error", event
            if event["type"] == "audio.start":
                current = event["sentence_index"]
                spoken.append(event["sentence_text"])
                audio[current] = bytearray()
            elif event["type"] == "audio.done":
                assert event["total_bytes"] == len(audio[event["sentence_index"]])
            elif event["type"] == "session.done":
                assert event["total_sentences"] == 3
                break
    assert spoken == sentences
    first = np.frombuffer(bytes(audio[0]), dtype="<i2")
    assert len(first) == len(expected["wav"])
    assert np.abs(first.astype(np.float64) - pcm_of(expected["wav"])).max() <= 1
    for i, sentence in enumerate(sentences[1:], start=1):
        alone = client.audio.speech.create(
            model=MODEL, input=sentence, voice="vivian", response_format="pcm", extra_body=SPOKEN
        )
        assert len(audio[i]) > 0
        assert bytes(audio[i]) == alone.content


def test_the_python_api_speaks_the_prompt_as_the_speech_api_does(
    served: Served, expected: dict[str, np.ndarray]
) -> None:
    """Omni.generate() of a text-to-speech graph reads its prompt aloud: the audio is
    qwen-tts's own for the seed; what the model cannot take is an OmniError naming it."""
    with Omni(base_url=served.base_url) as omni:
        [result] = omni.generate(TEXT, voice="vivian", seed=42, language="english", max_tokens=30)
        with pytest.raises(OmniError) as refused:
            omni.generate(TEXT, voice="alloy")
        with pytest.raises(OmniError) as imaged:
            omni.generate(TEXT, output_modalities=["image"])
        # What a text-to-speech graph has no use for is refused, never dropped unsaid.
        with pytest.raises(OmniError) as unused:
            omni.generate(TEXT, voice="vivian", temperature=0.5)
        with pytest.raises(OmniError) as too_long:
            omni.generate(TEXT, voice="vivian", max_tokens=40_000)
    pcm = samples_of(result.audio_wav)
    assert len(pcm) == len(expected["wav"])
    assert np.abs(pcm.astype(np.float64) - pcm_of(expected["wav"])).max() <= 1
    assert {o.final_output_type for o in result.outputs} == {"audio"}
    assert {o.stage for o in result.outputs} == {"code2wav"}
    assert (refused.value.status, refused.value.param) == (400, "voice")
    assert (imaged.value.status, imaged.value.param) == (400, "output_modalities")
    assert (unused.value.status, unused.value.param) == (400, "temperature")
    assert (too_long.value.status, too_long.value.param) == (400, "max_tokens")


def test_the_voices_listing_names_the_model_presets(served: Served) -> None:
    """GET /v1/audio/voices on a CustomVoice model: its preset speakers, asked of the
    talker, and no uploaded voice yet."""
    listed = httpx.get(f"{served.base_url}/audio/voices", timeout=30)
    assert listed.status_code == 200, listed.text
    body = listed.json()
    assert sorted(body["voices"]) == ["dylan", "ryan", "vivian"]
    assert body["data"] == [{"object": "voice", "name": n, "preset": True} for n in body["voices"]]
    assert body["uploaded_voices"] == []


def test_what_the_model_cannot_speak_is_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="dylan, ryan, vivian") as refused:
        client.audio.speech.create(model=MODEL, input=TEXT, voice="alloy")
    assert refused.value.body["param"] == "voice"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="english") as refused:
        client.audio.speech.create(
            model=MODEL, input=TEXT, voice="ryan", extra_body={"language": "klingon"}
        )
    assert refused.value.body["param"] == "language"  # type: ignore[index]
    # Cloning is the Base model's: a CustomVoice model refuses a reference clip.
    with pytest.raises(openai.BadRequestError, match="only a Base model clones") as refused:
        client.audio.speech.create(
            model=MODEL, input=TEXT, voice="ryan", extra_body={"ref_audio": "data:,"}
        )
    assert refused.value.body["param"] == "ref_audio"  # type: ignore[index]
    # A speech graph draws nothing: the image route says so, naming the model.
    with pytest.raises(openai.BadRequestError, match="makes no images") as refused:
        client.images.generate(model=MODEL, prompt="a lighthouse")
    assert refused.value.body["param"] == "model"  # type: ignore[index]


def test_a_client_that_hangs_up_mid_speech_frees_both_stages(
    client: openai.OpenAI, served: Served
) -> None:
    """POST /v1/audio/speech streamed, the client gone after its first audio: the router
    cancels the request on the talker and code2wav at once, and neither records it as
    completed."""
    stages = ("talker-0", "code2wav-0")

    def load() -> list[float]:
        return [
            served.metric(s, "omnipipe_stage_requests_running")
            + served.metric(s, "omnipipe_stage_requests_waiting")
            for s in stages
        ]

    def completed() -> list[float]:
        return [served.metric(s, "omnipipe_stage_request_duration_seconds_count") for s in stages]

    before = completed()
    long = {"max_tokens": 3000, "min_tokens": 3000}  # minutes of speech: it cannot end first
    spoken = {"sampling_params_list": [long], "initial_codec_chunk_frames": 1, "seed": 1}
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, input=TEXT, voice="vivian", response_format="pcm", extra_body=spoken
    ) as streamed:
        pieces = streamed.iter_bytes(1024)  # kept: a dropped iterator closes the stream
        assert next(pieces)  # audio: both stages hold the request
        assert load() == [1, 1]
    deadline = time.monotonic() + 10
    while load() != [0, 0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert load() == [0, 0], "the stages still hold the abandoned speech"
    assert completed() == before  # cancelled, not finished


def wav_of(data_url: str) -> bytes:
    return base64.b64decode(data_url.partition(",")[2])


def test_a_base_model_speaks_in_the_voice_of_the_clip_sent(tmp_path: Path) -> None:
    """A reference clip in the request's ref_audio (a data: URL of a WAV), cloned from its
    x-vector, and in context with its transcript (ref_text): the speech is qwen-tts's
    generate_voice_clone's for the seed, and so is that of the clip uploaded as a voice
    (with its transcript: in context), spoken from the prompt the talker made of it at
    the upload."""
    base = "tiny://qwen3-tts-base"
    reference_clip = clip(2.0)
    transcript = "A clip to clone."
    spoken = {**SPOKEN, "ref_audio": reference_clip, "x_vector_only_mode": True}
    in_context = {**SPOKEN, "ref_audio": reference_clip, "ref_text": transcript}
    case = {**{k: SPOKEN[k] for k in ("seed", "language", "max_new_tokens")}, "text": TEXT}
    expected = reference_outputs(
        {
            "base": ("qwen3-tts-base", {**case, "ref_audio": reference_clip}),
            "icl": (
                "qwen3-tts-base",
                {**case, "ref_audio": reference_clip, "ref_text": transcript},
            ),
        }
    )
    serve = start_serve(on_transformers(tmp_path, base))
    try:
        with openai.OpenAI(base_url=serve.base_url, api_key="any", max_retries=0) as c:
            r = c.audio.speech.create(model=base, input=TEXT, voice="alloy", extra_body=spoken)
            icl = c.audio.speech.create(
                model=base, input=TEXT, voice="alloy", extra_body=in_context
            )
            with pytest.raises(openai.BadRequestError, match="clones the voice") as refused:
                c.audio.speech.create(model=base, input=TEXT, voice="alloy")
            no_text = {**SPOKEN, "ref_audio": reference_clip}
            with pytest.raises(openai.BadRequestError, match="transcript") as untold:
                c.audio.speech.create(model=base, input=TEXT, voice="alloy", extra_body=no_text)
            # The same clip uploaded once as a voice, then spoken by its name.
            wav_bytes = wav_of(reference_clip)
            made = httpx.post(
                f"{serve.base_url}/audio/voices",
                data={"name": "reader", "consent": "true"},
                files={"audio_sample": ("reader.wav", wav_bytes, "audio/wav")},
                timeout=30,
            )
            assert made.status_code == 200, made.text
            by_name = c.audio.speech.create(
                model=base, input=TEXT, voice="reader", extra_body=SPOKEN
            )
            told = httpx.post(
                f"{serve.base_url}/audio/voices",
                data={"name": "teller", "consent": "true", "ref_text": transcript},
                files={"audio_sample": ("teller.wav", wav_bytes, "audio/wav")},
                timeout=30,
            )
            assert told.status_code == 200, told.text
            told_by_name = c.audio.speech.create(
                model=base, input=TEXT, voice="teller", extra_body=SPOKEN
            )
            # The talker encodes a voice's clip at its upload, and refuses one too short.
            brief = httpx.post(
                f"{serve.base_url}/audio/voices",
                data={"name": "brief", "consent": "true"},
                files={"audio_sample": ("brief.wav", wav_of(clip(0.5)), "audio/wav")},
                timeout=30,
            )
        # The Python API speaks the uploaded voice too.
        with Omni(base_url=serve.base_url) as omni:
            [said] = omni.generate(TEXT, voice="reader", seed=42, language="english", max_tokens=30)
    finally:
        stop_cleanly(serve)
    pcm = samples_of(r.content)
    assert len(pcm) == len(expected["base"]["wav"])
    assert np.abs(pcm.astype(np.float64) - pcm_of(expected["base"]["wav"])).max() <= 1
    assert np.abs(pcm).max() > 10
    # In context: qwen-tts's audio past the clip's, whose cut its float rounding may place
    # one sample early (tests/unit/test_qwen3_tts_cloning.py).
    pcm, wav = samples_of(icl.content), expected["icl"]["wav"]
    assert len(pcm) == len(expected["icl"]["codes"]) * SAMPLES_PER_FRAME
    assert 0 <= len(wav) - len(pcm) <= 1
    assert np.abs(pcm.astype(np.float64) - pcm_of(wav[len(wav) - len(pcm) :])).max() <= 1
    assert icl.content != r.content
    assert refused.value.body["param"] == "ref_audio"  # type: ignore[index]
    assert untold.value.body["param"] == "ref_text"  # type: ignore[index]
    assert by_name.content == r.content
    assert told_by_name.content == icl.content
    assert brief.status_code == 400, brief.text
    assert brief.json()["error"]["param"] == "audio_sample"
    assert "at least 1 s" in brief.json()["error"]["message"]
    assert samples_of(said.audio_wav).tobytes() == r.content[44:]  # the same, past the header


def test_the_talker_on_vllm_speaks_qwen_tts_own_greedy_speech(tmp_path: Path) -> None:
    """`engine: vllm` on the talker: the served greedy WAV is generate_custom_voice's."""
    case = {"text": TEXT, "speaker": "ryan", "language": "english"}
    expected = reference_outputs({"greedy": ("qwen3-tts-custom-voice", case)})["greedy"]
    manifest = tmp_path / "tts-vllm.yaml"
    manifest.write_text(
        f"""apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {{name: tts-vllm}}
spec:
  model: {MODEL}
  pipeline: qwen3-tts
  stages:
  - name: talker
    engine: vllm
    engineArgs: {{max_model_len: 2048}}
"""
    )
    serve = start_serve(manifest)
    try:
        with openai.OpenAI(base_url=serve.base_url, api_key="any", max_retries=0) as c:
            r = c.audio.speech.create(
                model="tts-vllm",
                input=TEXT,
                voice="ryan",
                extra_body={"language": "english", "sampling_params_list": [{"temperature": 0}]},
            )
    finally:
        stop_cleanly(serve)
    pcm = samples_of(r.content)
    assert len(pcm) == len(expected["codes"]) * SAMPLES_PER_FRAME == len(expected["wav"])
    assert np.abs(pcm.astype(np.float64) - pcm_of(expected["wav"])).max() <= 1
