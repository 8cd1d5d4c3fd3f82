"""Qwen3-TTS's stages against the model authors' own qwen-tts on the same tiny
checkpoints: for a seed (and greedy) the talker's codes equal generate()'s, and the audio
that code2wav streams in chunks equals the reference's within one 16-bit step."""

from __future__ import annotations

import base64
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.api.spec import Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.stagekit.stage import Chunk, StageInputError, StageJob, StreamingStage
from omnipipe.worker.stage_classes import stage_class
from tests.harness.tts_reference import pcm_of, reference_outputs
from tests.harness.voice_clips import clip
from tests.unit.test_omni_stages import spec

# The first run builds three tiny checkpoints and runs qwen-tts once in its side
# environment: about a minute alone, more beside other work.
pytestmark = pytest.mark.timeout(600)
TEXT = "Hello world, this is a test."
ONE_STEP = 1 / 32768  # a 16-bit sample's step


CASES: dict[str, list[dict[str, Any]]] = {
    "qwen3-tts-custom-voice": [
        {"name": "greedy", "text": TEXT, "speaker": "ryan", "language": "english"},
        {
            "name": "seeded-instruct",
            "text": "Where is the station? Turn left.",
            "speaker": "vivian",
            "language": "auto",
            "instruct": "Speak slowly.",
            "seed": 1234,
            "max_new_tokens": 40,
        },
        {  # a dialect speaker: Chinese is spoken in its dialect
            "name": "seeded-dialect",
            "text": "你好，世界。",  # noqa: RUF001
            "speaker": "dylan",
            "language": "chinese",
            "seed": 7,
            "max_new_tokens": 24,
        },
    ],
    "qwen3-tts-voice-design": [
        {
            "name": "seeded",
            "text": TEXT,
            "language": "english",
            "instruct": "A calm, low voice.",
            "seed": 5,
            "max_new_tokens": 40,
        },
    ],
    "qwen3-tts-base": [  # the voice of a reference clip, from its x-vector
        {"name": "greedy", "text": TEXT, "language": "english", "ref_audio": clip(2.0)},
        {
            "name": "seeded",
            "text": "Where is the station?",
            "language": "auto",
            "ref_audio": clip(3.0, seed=1),
            "seed": 10,  # 21 frames, then its end (seed 11 ended at 3 frames, too few to chunk)
            "max_new_tokens": 40,
        },
    ],
}


def params_of(case: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = {"input": case["text"], "language": case["language"]}
    if case.get("speaker"):
        params["voice"] = case["speaker"]
    if case.get("instruct"):
        params["instructions"] = case["instruct"]
    if case.get("ref_text"):
        params.update(ref_audio=case["ref_audio"], ref_text=case["ref_text"])
    elif case.get("ref_audio"):
        params.update(ref_audio=case["ref_audio"], x_vector_only_mode=True)
    sampling: dict[str, Any] = {}
    if case.get("seed") is None:
        sampling["temperature"] = 0
    else:
        params["seed"] = case["seed"]
    if case.get("max_new_tokens"):
        sampling["max_tokens"] = case["max_new_tokens"]
    params["sampling"] = sampling
    return params


@functools.cache
def load(model: str, role: Role, chunk: int = 5) -> Any:
    """The stage, loaded once per module. Chunks of 5 frames by default: the audio must
    not depend on how it was chunked (the first chunk is the request's own, below)."""
    path = resolve_model_path(f"tiny://{model}")
    stage_spec = spec(role.value, role, f"tiny://{model}", engine_args={"chunk_codes": chunk})
    stage = stage_class(stage_spec, path)(stage_spec, path, "cpu")
    stage.load()
    return stage


def speak(talker: StreamingStage, code2wav: StreamingStage, params: dict[str, Any]) -> Any:
    """The talker's frames and code2wav's audio, each chunk handed on as the worker does."""
    session = talker.open(StageJob(params, {}))
    decoder = code2wav.open(StageJob(params, {}))
    frames, audio = [], []
    while True:
        step = session.step([])
        assert step is not None
        pending = []
        if step.tensors or step.done:
            if "codes" in step.tensors:
                frames.append(step.tensors["codes"])
            pending = [Chunk("talker", dict(step.tensors), final=step.done)]
        # Everything code2wav can decode of what it has, as the worker steps it.
        while (out := decoder.step(pending)) is not None:
            pending = []
            audio.extend(np.frombuffer(_pcm(o), dtype="<i2") for o in out.outputs)
            if out.done:
                break
        if step.done:
            break
    session.close()
    decoder.close()
    return torch.cat(frames).numpy(), np.concatenate(audio) if audio else np.zeros(0, "<i2")


def _pcm(output: dict[str, Any]) -> bytes:
    return base64.b64decode(output["audio"])


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, Any]]:
    """Every case's codes and audio from qwen-tts."""
    return reference_outputs(
        {f"{model}-{c['name']}": (model, c) for model, cases in CASES.items() for c in cases}
    )


@pytest.mark.parametrize(
    ("model", "case"),
    [(model, case) for model, cases in CASES.items() for case in cases],
    ids=lambda v: v["name"] if isinstance(v, dict) else v,
)
def test_codes_and_audio_equal_qwen_tts(
    model: str, case: dict[str, Any], reference: dict[str, dict[str, Any]]
) -> None:
    talker, code2wav = load(model, Role.TALKER), load(model, Role.CODE2WAV)
    expected = reference[f"{model}-{case['name']}"]
    codes, pcm = speak(talker, code2wav, {**params_of(case), "initial_codec_chunk_frames": 2})
    assert len(expected["codes"]) > 5, "too short to be chunked"
    np.testing.assert_array_equal(codes, expected["codes"])
    wav = expected["wav"]
    assert len(pcm) == len(wav)
    assert np.abs(pcm.astype(np.float64) - pcm_of(wav)).max() <= 1
    assert np.abs(wav).max() > 10 * ONE_STEP  # audible: the comparison is not of silence


def test_sessions_stepped_together_each_equal_qwen_tts(
    reference: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The talker's sessions stepped as the worker hands them over (their code predictors
    run as one batch), each opened a step after the last and ending at its own length:
    every session's codes are still qwen-tts's own for its case, greedy or seeded."""
    model = "qwen3-tts-custom-voice"
    talker = load(model, Role.TALKER)
    batches: list[int] = []
    frames_of = talker.model.frames

    def counted(past_hidden: torch.Tensor, *args: Any) -> Any:
        batches.append(past_hidden.shape[0])
        return frames_of(past_hidden, *args)

    monkeypatch.setattr(talker.model, "frames", counted)
    waiting = list(CASES[model])
    live: dict[str, Any] = {}
    codes: dict[str, list[torch.Tensor]] = {c["name"]: [] for c in waiting}
    while waiting or live:
        if waiting:
            case = waiting.pop(0)
            live[case["name"]] = talker.open(StageJob(params_of(case), {}))
        names = list(live)
        outcomes = talker.step_sessions([(live[n], []) for n in names])
        for name, step in zip(names, outcomes, strict=True):
            assert step is not None
            assert not isinstance(step, Exception), step
            if "codes" in step.tensors:
                codes[name].append(step.tensors["codes"])
            if step.done:
                live.pop(name).close()
    assert max(batches) == len(CASES[model])  # all three completed frames as one batch
    for case in CASES[model]:
        expected = reference[f"{model}-{case['name']}"]["codes"]
        np.testing.assert_array_equal(torch.cat(codes[case["name"]]).numpy(), expected)


def test_a_request_the_model_cannot_speak_is_refused_by_name() -> None:
    custom = load("qwen3-tts-custom-voice", Role.TALKER)
    design = load("qwen3-tts-voice-design", Role.TALKER)
    ryan = {"input": TEXT, "voice": "ryan"}
    refused = [
        ("voice", custom, {"input": TEXT, "voice": "alloy"}),
        ("voice", custom, {"input": TEXT}),  # qwen-tts needs a speaker: no silent default
        ("language", custom, {**ryan, "language": "klingon"}),
        ("instructions", design, {"input": TEXT}),
        ("task_type", custom, {**ryan, "task_type": "VoiceDesign"}),
        ("max_new_tokens", custom, {**ryan, "sampling": {"max_tokens": 1}}),
        # Past the talker's positions (its KV cache would grow past what it was made for).
        ("max_new_tokens", custom, {**ryan, "sampling": {"max_tokens": 40_000}}),
        ("initial_codec_chunk_frames", custom, {**ryan, "initial_codec_chunk_frames": 0}),
        ("initial_codec_chunk_frames", custom, {**ryan, "initial_codec_chunk_frames": "x"}),
        ("input", custom, {"input": "  "}),
    ]
    for param, stage, params in refused:
        with pytest.raises(StageInputError) as caught:
            stage.open(StageJob(params, {}))
        assert caught.value.param == param, caught.value.message
    base = load("qwen3-tts-base", Role.TALKER)
    cloned = {"input": TEXT, "ref_audio": clip(1.0), "x_vector_only_mode": True}
    for param, stage, params in [
        ("ref_audio", custom, {**ryan, "ref_audio": clip(1.0)}),  # only Base clones
        ("x_vector_only_mode", design, {"input": TEXT, "x_vector_only_mode": True}),
        ("ref_audio", base, {"input": TEXT, "x_vector_only_mode": True}),
        # In context (qwen-tts's default) reads the clip's transcript: none was sent.
        ("ref_text", base, {**cloned, "x_vector_only_mode": False}),
        ("x_vector_only_mode", base, {**cloned, "x_vector_only_mode": "yes"}),
        ("instructions", base, {**cloned, "instructions": "Whisper."}),
        ("ref_audio", base, {**cloned, "ref_audio": "bm90IGEgd2F2"}),  # "not a wav"
        ("ref_audio", base, {**cloned, "ref_audio": clip(61.0, rate=8000)}),  # past 60 s
        ("ref_audio", base, {**cloned, "ref_audio": clip(1.0, rate=4000)}),  # under 8 kHz
    ]:
        with pytest.raises(StageInputError) as caught:
            stage.open(StageJob(params, {}))
        assert caught.value.param == param, caught.value.message
    # The preset voices are named in the refusal.
    with pytest.raises(StageInputError, match="dylan, ryan, vivian"):
        custom.open(StageJob({"input": TEXT, "voice": "alloy"}, {}))


def test_long_speech_decoded_together_equals_qwen_tts_past_its_300_frame_windows() -> None:
    """qwen-tts decodes 300 frames at a time after 25 of context: two requests' 330 frames
    each, decoded in shared forwards, in chunks that do not line up with those windows,
    equal the reference's decode of the same codes."""
    # Chunks of 40 frames: each decode starts at its window's context, so small chunks
    # late in a window cost most of the window each.
    code2wav = load("qwen3-tts-custom-voice", Role.CODE2WAV, 40)
    g = torch.Generator().manual_seed(3)
    codes = [torch.randint(0, 64, (330, 16), generator=g) for _ in range(2)]
    expected = reference_outputs(
        {
            f"decode-{i}": ("qwen3-tts-custom-voice", {"decode": c.tolist()})
            for i, c in enumerate(codes)
        }
    )
    sessions = [code2wav.open(StageJob({}, {})) for _ in codes]
    audio: list[list[np.ndarray]] = [[], []]
    sizes = [7] + [41] * 8  # 335 frames offered; the last chunk is short and final
    sent = 0
    done = [False, False]
    for size in sizes:
        chunks = [
            [Chunk("talker", {"codes": c[sent : sent + size]}, final=sent + size >= len(c))]
            for c in codes
        ]
        sent += size
        while not all(done):
            outcomes = code2wav.step_sessions(list(zip(sessions, chunks, strict=True)))
            chunks = [[], []]
            if all(o is None for o in outcomes):
                break
            for i, outcome in enumerate(outcomes):
                assert not isinstance(outcome, Exception), outcome
                if outcome is not None:
                    audio[i].extend(np.frombuffer(_pcm(o), "<i2") for o in outcome.outputs)
                    done[i] = done[i] or outcome.done
    assert all(done)
    for i in range(2):
        pcm = np.concatenate(audio[i]).astype(np.float64)
        wav = expected[f"decode-{i}"]["wav"]
        assert len(pcm) == len(wav) == 330 * 1920
        assert np.abs(pcm - pcm_of(wav)).max() <= 1


def test_a_clip_sent_again_is_not_encoded_again() -> None:
    """An uploaded voice comes with every request that names it: its x-vector is made
    once (and equals the first), another clip's is made anew."""
    base = load("qwen3-tts-base", Role.TALKER)
    encoder = base.speaker_encoder
    made: list[int] = []
    original = encoder.x_vector

    def counted(waveform: Any) -> torch.Tensor:
        made.append(len(waveform))
        vector: torch.Tensor = original(waveform)
        return vector

    encoder.x_vector = counted
    try:
        voice = {"input": TEXT, "x_vector_only_mode": True}
        first = base.open(StageJob({**voice, "ref_audio": clip(1.0, seed=3)}, {})).voice
        # As the worker opens a session: prepare() first, off the engine thread.
        job = StageJob({**voice, "ref_audio": clip(1.0, seed=3)}, {})
        base.prepare(job)
        assert job.prepared[1] is None  # kept: not even decoded again
        again = base.open(job).voice
        job = StageJob({**voice, "ref_audio": clip(1.0, seed=4)}, {})
        base.prepare(job)
        other = base.open(job).voice
    finally:
        del encoder.x_vector
    assert made == [24000, 24000]
    assert torch.equal(first.x_vector, again.x_vector)
    assert not torch.equal(first.x_vector, other.x_vector)


def test_the_released_base_config_takes_qwen_tts_speaker_encoder_defaults(
    tmp_path: Path,
) -> None:
    """The released Base configs give the speaker encoder only enc_dim and sample_rate:
    the rest is Qwen3TTSSpeakerEncoderConfig's defaults, as qwen-tts reads them."""
    from omnipipe.families.qwen3_tts.config import read_config
    from omnipipe.families.qwen3_tts.speaker_encoder import SpeakerEncoder

    checkpoint = Path(resolve_model_path("tiny://qwen3-tts-base"))
    released = tmp_path / "base"
    shutil.copytree(checkpoint, released, ignore=shutil.ignore_patterns("*.safetensors"))
    doc = json.loads((released / "config.json").read_text())
    doc["speaker_encoder_config"] = {"enc_dim": 2048, "sample_rate": 24000}
    (released / "config.json").write_text(json.dumps(doc))
    config = read_config(str(released)).speaker_encoder
    assert config["enc_channels"] == [512, 512, 512, 512, 1536]
    assert (config["enc_dim"], config["mel_dim"], config["enc_attention_channels"]) == (
        2048,
        128,
        128,
    )
    encoder = SpeakerEncoder(config)
    assert encoder.fc.out_channels == 2048
    assert encoder.blocks[1].res2net_block.scale == 8


def test_clips_too_short_are_refused_and_other_rates_resampled() -> None:
    """Under a second is a 400 (the encoder's padding needs more, and so does a voice); a
    48 kHz clip is resampled to 24 kHz with a low-pass filter: its x-vector is near the
    24 kHz clip's, and another voice's is further away."""
    from omnipipe.families.qwen3_tts.clips import reference_clip

    with pytest.raises(StageInputError, match="at least 1 s") as short:
        reference_clip(clip(0.5))
    assert short.value.param == "ref_audio"
    at_48k = reference_clip(clip(2.0, rate=48000))
    assert len(at_48k) == pytest.approx(48000, abs=64)
    encoder = load("qwen3-tts-base", Role.TALKER).speaker_encoder
    same = torch.cosine_similarity(
        encoder.x_vector(at_48k), encoder.x_vector(reference_clip(clip(2.0))), dim=0
    )
    other = torch.cosine_similarity(
        encoder.x_vector(at_48k), encoder.x_vector(reference_clip(clip(2.0, seed=5))), dim=0
    )
    assert same > 0.99
    assert same > other


def test_a_model_with_presets_speaks_its_preset_whatever_clip_was_uploaded() -> None:
    """The router sends an uploaded voice's clip (voice_clip) with every request that names
    it: a CustomVoice model speaks its preset of that name and reads no clip; a Base model
    clones the clip."""
    custom = load("qwen3-tts-custom-voice", Role.TALKER)
    uploaded = {"input": TEXT, "voice": "ryan", "voice_clip": clip(1.0)}
    voice = custom.open(StageJob(uploaded, {})).voice
    assert (voice.speaker, voice.x_vector) == ("ryan", None)
    cloned = load("qwen3-tts-base", Role.TALKER).open(StageJob(uploaded, {})).voice
    assert cloned.speaker is None
    assert cloned.x_vector is not None
