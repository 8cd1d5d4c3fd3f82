"""The Qwen3-Omni stages on tiny://qwen3-omni, driven by hand (no processes): the whole
chain equals Qwen3OmniMoeForConditionalGeneration.generate, streaming equals all at once."""

from __future__ import annotations

import base64
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.api.spec import Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.qwen_omni.checkpoint import QWEN3_OMNI, omni_model_type
from omnipipe.families.qwen_omni.transformers.code2wav import Qwen3Code2WavStage
from omnipipe.families.qwen_omni.transformers.qwen3_talker import Qwen3TalkerStage
from omnipipe.families.qwen_omni.transformers.thinker import Qwen3ThinkerStage
from omnipipe.stagekit.media import pcm16
from omnipipe.stagekit.stage import Chunk, StageInputError, StageJob
from omnipipe.worker.stage_classes import stage_class
from tests.unit.test_omni_stages import (
    assert_alike,
    audio_in_parts,
    count_calls,
    decode_alone,
    drain,
    spec,
    step_together,
)

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny://qwen3-omni"
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def path() -> str:
    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def thinker(path: str) -> Qwen3ThinkerStage:
    stage = Qwen3ThinkerStage(spec("thinker", Role.THINKER, MODEL), path, "cpu")
    stage.load()
    return stage


@pytest.fixture(scope="module")
def talker(path: str) -> Qwen3TalkerStage:
    stage = Qwen3TalkerStage(spec("talker", Role.TALKER, MODEL), path, "cpu")
    stage.load()
    return stage


@pytest.fixture(scope="module")
def code2wav(path: str) -> Qwen3Code2WavStage:
    stage = Qwen3Code2WavStage(spec("code2wav", Role.CODE2WAV, MODEL), path, "cpu")
    stage.load()
    return stage


def test_the_checkpoint_picks_the_qwen3_stage_classes(path: str) -> None:
    assert omni_model_type(path) == QWEN3_OMNI
    assert stage_class(spec("talker", Role.TALKER, MODEL), path) is Qwen3TalkerStage
    qwen25 = resolve_model_path("tiny://qwen2.5-omni")
    assert stage_class(spec("talker", Role.TALKER), qwen25) is not Qwen3TalkerStage


def run_chain(
    thinker: Qwen3ThinkerStage,
    talker: Qwen3TalkerStage,
    messages: list[dict[str, Any]],
    thinker_sampling: dict[str, Any],
    talker_sampling: dict[str, Any],
    together: bool = False,
) -> tuple[str, list[list[int]]]:
    """Text from the thinker and the talker's frames, the talker fed chunk by chunk as the
    thinker makes them (or all at once)."""
    job = {"messages": messages, "audio": True, "voice": "Ethan"}
    session = thinker.open(StageJob({**job, "sampling": thinker_sampling}, {}))
    text, chunks = "", []
    for step in drain(session):
        text += "".join(o.get("text", "") for o in step.outputs)
        if step.tensors or step.done:
            chunks.append(Chunk("thinker", step.tensors, step.done))
    speaking = talker.open(StageJob({**job, "sampling": talker_sampling}, {}))
    frames: list[list[int]] = []
    for feed in [chunks] if together else [[c] for c in chunks]:
        for step in drain(speaking, feed):
            if "codes" in step.tensors:
                frames += step.tensors["codes"].tolist()
    return text, frames


def reference(path: str, inputs: dict[str, Any], thinker_tokens: int, talker_tokens: int) -> Any:
    """transformers' generate, greedy in both AR parts; returns the text ids, the codes it
    decoded, and its code2wav's chunked_decode."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path).eval()
    model.talker.config.audio_config = model.config.thinker_config.audio_config
    seen: dict[str, torch.Tensor] = {}
    decode = model.code2wav.chunked_decode

    def capture(codes: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen["codes"] = codes
        result: torch.Tensor = decode(codes, **kwargs)
        return result

    model.code2wav.chunked_decode = capture
    with warnings.catch_warnings():
        # "the penalty applies only to newly generated tokens": so does the talker stage's.
        warnings.filterwarnings("ignore", "Passing `repetition_penalty`", UserWarning)
        sequences, _ = model.generate(
            **inputs,
            speaker="Ethan",
            thinker_max_new_tokens=thinker_tokens,
            thinker_do_sample=False,
            talker_max_new_tokens=talker_tokens,
            talker_do_sample=False,
        )
    return sequences, seen["codes"][0].T.tolist(), decode


def processed(thinker: Qwen3ThinkerStage, messages: list[dict[str, Any]]) -> dict[str, Any]:
    conversation, media = thinker.conversation(messages)
    text = thinker.processor.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False
    )
    return dict(
        thinker.processor(
            text=[text],
            images=media.images or None,
            audio=media.audios or None,
            return_tensors="pt",
        )
    )


def media_message() -> list[dict[str, Any]]:
    import io
    import wave

    from PIL import Image

    rng = np.random.default_rng(0)
    png = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(png, "PNG")
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm16(rng.standard_normal(16000).astype(np.float32) * 0.1))
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "data": base64.b64encode(png.getvalue()).decode()},
                {"type": "audio", "data": base64.b64encode(wav.getvalue()).decode()},
                {"type": "text", "text": "what is this?"},
            ],
        }
    ]


@pytest.mark.parametrize("with_media", [False, True], ids=["text", "image+audio"])
def test_the_chain_equals_transformers_generate(
    path: str,
    thinker: Qwen3ThinkerStage,
    talker: Qwen3TalkerStage,
    code2wav: Qwen3Code2WavStage,
    with_media: bool,
) -> None:
    # A prompt whose greedy answer runs past one chunk of frames on the tiny weights.
    messages = media_message() if with_media else [{"role": "user", "content": "good morning"}]
    text, frames = run_chain(
        thinker,
        talker,
        messages,
        {"temperature": 0, "max_tokens": 8},
        {"temperature": 0, "max_tokens": 40},
    )
    inputs = processed(thinker, messages)
    sequences, codes, chunked_decode = reference(path, inputs, 8, 40)
    reply = sequences[0, inputs["input_ids"].shape[1] :]
    assert text == thinker.tokenizer.decode(reply, skip_special_tokens=True)
    assert frames == codes
    assert len(frames) > 10
    # The streamed audio, decoded in 25-frame chunks, equals chunked_decode's.
    session = code2wav.open(StageJob({"voice": "Ethan"}, {}))
    pcm = b"".join(
        base64.b64decode(o["audio"])
        for step in drain(session, [Chunk("talker", {"codes": torch.tensor(frames)}, True)])
        for o in step.outputs
    )
    with torch.inference_mode():
        expected = chunked_decode(torch.tensor(frames).T[None], chunk_size=25, left_context_size=25)
    assert pcm == pcm16(expected.reshape(-1).numpy())
    assert np.abs(np.frombuffer(pcm, np.int16)).max() > 100  # audible, not silence


def test_talker_streaming_equals_all_at_once(
    thinker: Qwen3ThinkerStage, talker: Qwen3TalkerStage
) -> None:
    sampling = {"temperature": 0.9, "max_tokens": 30, "seed": 4}
    greedy = {"temperature": 0, "max_tokens": 12}
    _, streamed = run_chain(thinker, talker, HELLO, greedy, sampling)
    _, together = run_chain(thinker, talker, HELLO, greedy, sampling, together=True)
    assert streamed == together
    assert len(streamed) == 29  # max_tokens counts the code that would start frame 30


def test_code2wav_audio_does_not_depend_on_chunking(code2wav: Qwen3Code2WavStage) -> None:
    frames = torch.arange(60 * 4).reshape(60, 4) % 64

    def audio(sizes: list[int]) -> bytes:
        return audio_in_parts(code2wav.open(StageJob({}, {})), frames, sizes)

    assert audio([25, 25, 10]) == audio([60]) == audio([7, 50, 3])


def test_code2wav_decodes_requests_together_as_each_alone(
    code2wav: Qwen3Code2WavStage, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = [
        torch.arange(60 * 4).reshape(60, 4) % 64,
        (torch.arange(60 * 4) * 5).reshape(60, 4) % 64,
    ]
    alone = [decode_alone(code2wav, {}, frames) for frames in requests]
    calls = count_calls(monkeypatch, code2wav.code2wav)
    sessions = [code2wav.open(StageJob({}, {})) for _ in requests]
    outputs = step_together(code2wav, sessions, requests)
    assert calls == [2, 2, 2]
    assert_alike(outputs, alone)


def test_voices_are_the_checkpoints_and_match_any_case(
    thinker: Qwen3ThinkerStage, code2wav: Qwen3Code2WavStage
) -> None:
    with pytest.raises(StageInputError, match="voices: Chelsie, Ethan"):
        code2wav.open(StageJob({"voice": "alloy"}, {}))
    with pytest.raises(StageInputError, match="voices"):
        thinker.open(StageJob({"messages": HELLO, "audio": True, "voice": "alloy"}, {}))
    thinker.open(StageJob({"messages": HELLO, "audio": True, "voice": "chelsie"}, {}))
