"""Qwen3-TTS Base cloning in context, against qwen-tts's generate_voice_clone with
ref_text: the reference clip's codes (the 12 Hz tokenizer's encoder, transformers' Mimi)
and its transcript lead the talker's prompt, and code2wav decodes the clip's codes ahead
of the speech and drops their audio. For a seed (and greedy) the codes are the
reference's, and the audio is within one 16-bit step of it."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.api.spec import Role
from omnipipe.families.qwen3_tts.clips import reference_clip
from omnipipe.stagekit.stage import StageInputError, StageJob
from tests.harness.tts_reference import pcm_of, reference_outputs
from tests.harness.voice_clips import clip
from tests.unit.test_qwen3_tts import ONE_STEP, TEXT, load, params_of, speak

pytestmark = pytest.mark.timeout(600)
MODEL = "qwen3-tts-base"
CASES = [
    {
        "name": "icl-greedy",
        "text": TEXT,
        "language": "english",
        "ref_audio": clip(2.3),
        "ref_text": "This is the reference.",
    },
    {  # the transcript outruns the clip's frames: its rest is what the steps add
        "name": "icl-seeded-long-transcript",
        "text": "Where is the station?",
        "language": "auto",
        "ref_audio": clip(1.2, seed=2),
        "ref_text": "A transcript far longer than a clip of barely more than a second holds "
        "in frames, so that its rows run on past the clip's codes in the prompt.",
        "seed": 10,  # 28 frames, then its end
        "max_new_tokens": 30,
    },
    {  # 313 frames of reference: code2wav's first window (300) ends inside the clip
        "name": "icl-seeded-past-a-window",
        "text": TEXT,
        "language": "english",
        "ref_audio": clip(25.0, seed=1),
        "ref_text": "Twenty-five seconds of reference.",
        "seed": 5,
        "max_new_tokens": 30,
    },
]


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, Any]]:
    asked = {c["name"]: (MODEL, c) for c in CASES}
    asked |= {f"encode-{c['name']}": (MODEL, {"encode": c["ref_audio"]}) for c in CASES}
    return reference_outputs(asked)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_reference_codes_equal_the_speech_tokenizers(
    case: dict[str, Any], reference: dict[str, dict[str, Any]]
) -> None:
    encoder = load(MODEL, Role.TALKER).reference_codes
    codes = encoder.codes(reference_clip(case["ref_audio"]))
    expected = reference[f"encode-{case['name']}"]["codes"]
    assert codes.shape == expected.shape
    assert codes.shape[1] == 16
    np.testing.assert_array_equal(codes.numpy(), expected)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_cloned_in_context_codes_and_audio_equal_qwen_tts(
    case: dict[str, Any], reference: dict[str, dict[str, Any]]
) -> None:
    talker, code2wav = load(MODEL, Role.TALKER), load(MODEL, Role.CODE2WAV)
    expected = reference[case["name"]]
    codes, pcm = speak(talker, code2wav, {**params_of(case), "initial_codec_chunk_frames": 2})
    assert len(expected["codes"]) > 5, "too short to be chunked"
    np.testing.assert_array_equal(codes, expected["codes"])
    wav = expected["wav"]
    # qwen-tts cuts the clip's audio at int(clip_frames / all_frames * samples), which
    # float rounding may leave one sample short of clip_frames x 1920: then its audio
    # starts one sample earlier. Ours is exactly the speech's frames x 1920.
    assert len(pcm) == len(codes) * 1920
    assert 0 <= len(wav) - len(pcm) <= 1
    tail = wav[len(wav) - len(pcm) :]
    assert np.abs(pcm.astype(np.float64) - pcm_of(tail)).max() <= 1
    assert np.abs(wav).max() > 10 * ONE_STEP  # audible: the comparison is not of silence


def test_an_uploaded_voice_with_a_transcript_is_cloned_in_context_once() -> None:
    """The router sends an uploaded voice's clip, and its transcript when it was uploaded
    with one: then the voice is cloned in context. The clip is encoded once (x-vector and
    codes), however many requests name it; x_vector_only_mode leaves the codes out."""
    talker = load(MODEL, Role.TALKER)
    made: list[int] = []
    original = talker.reference_codes.codes

    def counted(waveform: Any) -> torch.Tensor:
        made.append(len(waveform))
        encoded: torch.Tensor = original(waveform)
        return encoded

    talker.reference_codes.codes = counted
    try:
        uploaded = {"input": TEXT, "voice": "mine", "voice_clip": clip(1.5, seed=9)}
        plain = talker.open(StageJob(uploaded, {})).voice
        with_text = {**uploaded, "voice_ref_text": "My own voice."}
        first = talker.open(StageJob(with_text, {})).voice
        job = StageJob(with_text, {})
        talker.prepare(job)
        assert job.prepared[1] is None  # kept: not even decoded again
        again = talker.open(job).voice
        only = talker.open(StageJob({**with_text, "x_vector_only_mode": True}, {})).voice
    finally:
        del talker.reference_codes.codes
    assert plain.reference_codes is None
    assert plain.x_vector is not None
    assert made == [36000]
    assert first.reference_text == "My own voice."
    assert first.reference_codes is not None
    assert torch.equal(first.reference_codes, again.reference_codes)
    assert torch.equal(first.x_vector, plain.x_vector)
    assert (only.reference_text, only.reference_codes) == (None, None)


def test_a_clip_too_long_for_the_talker_with_its_input_is_refused_by_name() -> None:
    """The clip's frames sit in the talker's prompt: a clip and text that leave no room
    for max_new_tokens in its positions are refused, naming max_new_tokens."""
    talker = load(MODEL, Role.TALKER)
    room = talker.config.max_positions
    frames = -(-60 * 24000 // 1920)
    params = {
        "input": TEXT,
        "ref_audio": clip(60.0, rate=8000),
        "ref_text": "A minute.",
        "sampling": {"max_tokens": room - frames},
    }
    with pytest.raises(StageInputError) as caught:
        talker.open(StageJob(params, {}))
    assert caught.value.param == "max_new_tokens"
    assert "clip" in caught.value.message
    # From its x-vector alone, the same clip takes no positions.
    talker.open(StageJob({**params, "x_vector_only_mode": True}, {})).close()


def test_a_voice_prompt_made_at_upload_speaks_as_qwen_tts_clones_its_clip(
    reference: dict[str, dict[str, Any]],
) -> None:
    """An uploaded voice's prompt (x-vector and codes, made once, kept by the router as
    JSON) in place of its clip: the same codes and audio as qwen-tts cloning the clip."""
    talker, code2wav = load(MODEL, Role.TALKER), load(MODEL, Role.CODE2WAV)
    case = CASES[0]
    prompt = json.loads(json.dumps(talker.voice_prompt(case["ref_audio"], case["ref_text"])))
    params = {
        **{k: v for k, v in params_of(case).items() if k not in ("ref_audio", "ref_text")},
        "voice": "mine",
        "voice_prompt": prompt,
        "voice_ref_text": case["ref_text"],
    }
    codes, pcm = speak(talker, code2wav, params)
    np.testing.assert_array_equal(codes, reference[case["name"]]["codes"])
    wav = reference[case["name"]]["wav"]
    assert np.abs(pcm.astype(np.float64) - pcm_of(wav[len(wav) - len(pcm) :])).max() <= 1
    # Made without a transcript: the x-vector alone, as x_vector_only_mode clones the clip.
    only = talker.voice_prompt(case["ref_audio"], None)
    assert "codes" not in only
    plain = {k: v for k, v in params.items() if k != "voice_ref_text"}
    from_prompt = speak(talker, code2wav, {**plain, "voice_prompt": only})[0]
    from_clip = speak(talker, code2wav, params_of({**case, "ref_text": None}))[0]
    np.testing.assert_array_equal(from_prompt, from_clip)


def test_a_prompt_another_model_made_or_a_bad_clip_is_refused_by_name() -> None:
    talker = load(MODEL, Role.TALKER)
    prompt = talker.voice_prompt(clip(1.5, seed=9), "My own voice.")
    short_vector = {**prompt, "x_vector": base64.b64encode(b"\0" * 8).decode()}
    high_code = np.frombuffer(base64.b64decode(prompt["codes"]), "<i2").copy()
    high_code[0] = 4000
    for bad in [
        short_vector,
        {**prompt, "x_vector": "not base64!"},
        {**prompt, "format": 99},
        {**prompt, "frames": prompt["frames"] + 1},
        {**prompt, "codes": base64.b64encode(high_code.tobytes()).decode()},
        "a string",
    ]:
        job = StageJob({"input": TEXT, "voice_prompt": bad, "voice_ref_text": "Mine."}, {})
        with pytest.raises(StageInputError) as caught:
            talker.open(job)
        assert caught.value.param == "voice"
        assert "upload the voice again" in caught.value.message
    with pytest.raises(StageInputError) as short:
        talker.voice_prompt(clip(0.5), None)
    assert short.value.param == "ref_audio"
    with pytest.raises(NotImplementedError, match="Base model"):
        load("qwen3-tts-custom-voice", Role.TALKER).voice_prompt(clip(1.5), None)
