"""The Qwen2.5-Omni stages on tiny://qwen2.5-omni, driven by hand (no processes):
hand-offs equal transformers' own, streaming equals all-at-once, chunks are stable."""

from __future__ import annotations

import base64
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.api import ResolvedStage
from omnipipe.api.spec import Engine, Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.qwen_omni.transformers.code2wav import Code2WavStage
from omnipipe.families.qwen_omni.transformers.qwen25_talker import TalkerStage
from omnipipe.families.qwen_omni.transformers.thinker import ThinkerStage
from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    StageInputError,
    StageJob,
    StepResult,
    StreamingStage,
)

pytestmark = pytest.mark.timeout(300)
HELLO = [{"role": "user", "content": "hello there"}]
GREEDY_6 = {"temperature": 0, "max_tokens": 6}


def spec(name: str, role: Role, model: str = "tiny://qwen2.5-omni", **fields: Any) -> ResolvedStage:
    return ResolvedStage(
        name=name,
        role=role,
        engine=Engine.TRANSFORMERS,
        model=model,
        inputs=(),
        replicas=1,
        cpu=None,
        memory=None,
        gpus=0,
        engine_args=fields.get("engine_args", {}),
        sampling=fields.get("sampling", {}),
        env=(),
        node_selector={},
        tolerations=(),
        autoscaling=None,
        target=None,
    )


@pytest.fixture(scope="module")
def path() -> str:
    return resolve_model_path("tiny://qwen2.5-omni")


@pytest.fixture(scope="module")
def thinker(path: str) -> ThinkerStage:
    stage = ThinkerStage(spec("thinker", Role.THINKER), path, "cpu")
    stage.load()
    return stage


@pytest.fixture(scope="module")
def talker(path: str) -> TalkerStage:
    stage = TalkerStage(spec("talker", Role.TALKER), path, "cpu")
    stage.load()
    return stage


@pytest.fixture(scope="module")
def code2wav(path: str) -> Code2WavStage:
    stage = Code2WavStage(spec("code2wav", Role.CODE2WAV), path, "cpu")
    stage.load()
    return stage


def drain(session: Session, chunks: Sequence[Chunk] = ()) -> Iterator[StepResult]:
    """Step until the session wants input or is done."""
    step = session.step(chunks)
    while step is not None:
        yield step
        if step.done:
            return
        step = session.step([])


def thinker_chunks(
    thinker: ThinkerStage,
    sampling: dict[str, Any],
    messages: list[dict[str, Any]] = HELLO,
    **params: Any,
) -> list[Chunk]:
    """The thinker's chunks for the talker of one request that wants audio."""
    job = StageJob({"messages": messages, "audio": True, "sampling": sampling, **params}, {})
    session = thinker.open(job)
    return [
        Chunk("thinker", step.tensors, step.done)
        for step in drain(session)
        if step.tensors or step.done
    ]


def test_thinker_text_equals_transformers_generate(thinker: ThinkerStage) -> None:
    session = thinker.open(StageJob({"messages": HELLO, "sampling": GREEDY_6}, {}))
    text = "".join(o.get("text", "") for step in drain(session) for o in step.outputs)
    inputs = thinker.processor(
        text=[
            thinker.processor.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
        ],
        return_tensors="pt",
    )
    ids = thinker.thinker.generate(**inputs, max_new_tokens=6, do_sample=False)
    expected = thinker.tokenizer.decode(
        ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    )
    assert text == expected


def test_thinker_hands_the_talker_what_transformers_does(path: str, thinker: ThinkerStage) -> None:
    """The talker's prefill embeddings and reply rows, against what
    Qwen2_5OmniForConditionalGeneration.generate passes to talker.generate."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path)
    seen: dict[str, Any] = {}

    class Captured(Exception):
        pass

    def capture(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise Captured

    model.talker.generate = capture
    inputs = thinker.processor(
        text=[
            thinker.processor.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
        ],
        return_tensors="pt",
    )
    with pytest.raises(Captured):
        model.generate(**inputs, thinker_max_new_tokens=6, thinker_do_sample=False)
    chunks = thinker_chunks(thinker, GREEDY_6)
    prompt = chunks[0].tensors
    rows = torch.cat([c.tensors["reply"] for c in chunks if "reply" in c.tensors])
    prefill = torch.cat([prompt["prompt_embeds"], prompt["text_bos_embed"][None], rows[:1]])
    torch.testing.assert_close(prefill, seen["inputs_embeds"][0], rtol=0, atol=1e-6)
    stream = torch.cat([rows[1:], prompt["text_eos_embed"][None], prompt["text_pad_embed"][None]])
    torch.testing.assert_close(stream, seen["thinker_reply_part"][0], rtol=0, atol=1e-6)
    assert torch.equal(
        torch.cat([prompt["input_ids"], prompt["text_bos_id"], prompt["first_token_id"]]),
        seen["input_text_ids"][0],
    )


# min_tokens holds back the stop codes, so every comparison covers 40 talker steps
# whatever the random weights favour.
TALKER_GREEDY_40 = {"temperature": 0, "max_tokens": 40, "min_tokens": 40}


def talker_codes(talker: TalkerStage, chunks: list[Chunk], together: bool) -> list[int]:
    session = talker.open(StageJob({"sampling": TALKER_GREEDY_40}, {}))
    codes: list[int] = []
    feeds = [chunks] if together else [[c] for c in chunks]
    for feed in feeds:
        for step in drain(session, feed):
            if "codes" in step.tensors:
                codes += step.tensors["codes"].tolist()
            if step.done:
                return codes
    return codes


def test_talker_streaming_equals_all_at_once(thinker: ThinkerStage, talker: TalkerStage) -> None:
    chunks = thinker_chunks(thinker, {"temperature": 0, "max_tokens": 20})
    assert len(chunks) > 5  # the thinker streamed row by row
    streamed = talker_codes(talker, chunks, together=False)
    assert streamed == talker_codes(talker, chunks, together=True)
    assert len(streamed) == 40


def audio_in_parts(session: Session, codes: torch.Tensor, sizes: list[int]) -> bytes:
    """The audio a code2wav session makes when the codes arrive in parts of these sizes."""
    out, start = b"", 0
    for i, size in enumerate(sizes):
        part = codes[start : start + size]
        start += size
        for step in drain(session, [Chunk("talker", {"codes": part}, i == len(sizes) - 1)]):
            out += b"".join(o["audio"].encode() for o in step.outputs)
    return out


def test_code2wav_audio_does_not_depend_on_chunking(code2wav: Code2WavStage) -> None:
    codes = torch.arange(60) % 128

    def audio(sizes: list[int]) -> bytes:
        return audio_in_parts(code2wav.open(StageJob({"seed": 5}, {})), codes, sizes)

    assert audio([25, 25, 10]) == audio([60]) == audio([7, 50, 3])


def test_unknown_voice_and_bad_media_are_input_errors(
    thinker: ThinkerStage, code2wav: Code2WavStage
) -> None:
    with pytest.raises(StageInputError, match="voices: Chelsie, Ethan"):
        code2wav.open(StageJob({"voice": "alloy"}, {}))
    with pytest.raises(StageInputError, match="voices"):
        thinker.open(StageJob({"messages": HELLO, "audio": True, "voice": "alloy"}, {}))
    image = [{"role": "user", "content": [{"type": "image", "data": "aGVsbG8="}]}]
    with pytest.raises(StageInputError, match=r"messages\[0\].content\[0\]: not a decodable"):
        thinker.open(StageJob({"messages": image}, {}))
    with pytest.raises(StageInputError, match="max_tokens"):
        thinker.open(StageJob({"messages": HELLO, "sampling": {"max_tokens": 0}}, {}))


def test_spec_sampling_is_the_default_and_requests_override_it(path: str) -> None:
    stage = ThinkerStage(
        spec("thinker", Role.THINKER, sampling={"max_tokens": 4, "min_tokens": 4}), path, "cpu"
    )
    stage.load()

    def tokens(sampling: dict[str, Any] | None) -> int:
        steps = list(drain(stage.open(StageJob({"messages": HELLO, "sampling": sampling}, {}))))
        return int(steps[-1].outputs[-1]["completion_tokens"])

    assert tokens(None) == 4
    assert tokens({"max_tokens": 2, "min_tokens": 2}) == 2


def test_a_prompt_past_the_context_is_refused_before_it_runs(path: str) -> None:
    stage = ThinkerStage(
        spec("thinker", Role.THINKER, engine_args={"max_model_len": 256}), path, "cpu"
    )
    stage.load()
    assert stage.context_length == 256
    with pytest.raises(StageInputError, match="this model's context is 256 tokens"):
        stage.open(StageJob({"messages": [{"role": "user", "content": "x" * 300}]}, {}))
    stage.open(StageJob({"messages": [{"role": "user", "content": "x" * 100}]}, {})).close()


def test_code2wav_decodes_requests_together_as_each_alone(
    code2wav: Code2WavStage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests' chunks of equal length (and left context) go through one DiT sampling
    and one vocoder pass, and each request's audio is what it gets alone: its own voice
    and its own seed's noise. Three requests of 60 codes and one of 40: chunks of 25, then
    25 + 25 of context (the 40-code one: 15 + 25, its own group), then 10 + 25."""
    requests: list[tuple[dict[str, Any], torch.Tensor]] = [
        ({"seed": 5, "voice": "Chelsie"}, torch.arange(60) % 128),
        ({"seed": 6, "voice": "Ethan"}, (torch.arange(60) * 7) % 128),
        ({"seed": 7}, (torch.arange(60) * 3 + 1) % 128),
        ({"seed": 8}, (torch.arange(40) * 5 + 2) % 128),
    ]
    alone = [decode_alone(code2wav, params, codes) for params, codes in requests]
    calls = count_calls(monkeypatch, code2wav.token2wav.code2wav_bigvgan_model)
    sessions = [code2wav.open(StageJob(params, {})) for params, _ in requests]
    outputs = step_together(code2wav, sessions, [codes for _, codes in requests])
    assert calls == [4, 3, 1, 3]
    assert_alike(outputs, alone)


def test_one_requests_bad_codes_fail_it_alone_not_its_batch(code2wav: Code2WavStage) -> None:
    good = [({"seed": 5}, torch.arange(30) % 128), ({"seed": 6}, (torch.arange(30) * 7) % 128)]
    bad = torch.arange(30) + 10_000  # past the codec's vocabulary: the embedding raises
    alone = [decode_alone(code2wav, params, codes) for params, codes in good]
    sessions = [code2wav.open(StageJob(params, {})) for params, _ in [*good, ({"seed": 7}, bad)]]
    outputs = step_together(code2wav, sessions, [codes for _, codes in good] + [bad])
    assert isinstance(outputs[2], IndexError), outputs[2]
    assert_alike(outputs[:2], alone)


def decode_alone(stage: StreamingStage, params: dict[str, Any], codes: torch.Tensor) -> np.ndarray:
    steps = drain(stage.open(StageJob(params, {})), [Chunk("talker", {"codes": codes}, True)])
    return samples([o for step in steps for o in step.outputs])


def count_calls(monkeypatch: pytest.MonkeyPatch, module: torch.nn.Module) -> list[int]:
    """The batch size of each forward of `module` from now on."""
    calls: list[int] = []
    forward = module.forward

    def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(x.shape[0])
        return forward(x, *args, **kwargs)

    monkeypatch.setattr(module, "forward", counted)
    return calls


def assert_alike(
    outputs: Sequence[list[dict[str, Any]] | Exception], alone: Sequence[np.ndarray]
) -> None:
    for made, solo in zip(outputs, alone, strict=True):
        assert not isinstance(made, Exception), made
        together = samples(made)
        assert together.shape == solo.shape
        assert solo.any()
        # Batched matmuls sum in another order: a float difference of ~1e-6 may move a
        # 16-bit sample by one step, never more.
        assert np.abs(together.astype(int) - solo.astype(int)).max() <= 1


def step_together(
    stage: StreamingStage, sessions: Sequence[Session], codes: Sequence[torch.Tensor]
) -> list[list[dict[str, Any]] | Exception]:
    """Each session given its codes at once, then all stepped together (as the runtime
    steps every session waiting) until each is done or failed; each one's outputs, or
    its error."""
    outputs: list[list[dict[str, Any]] | Exception] = [[] for _ in sessions]
    chunks: list[list[Chunk]] = [[Chunk("talker", {"codes": c}, True)] for c in codes]
    done: set[int] = set()
    while len(done) < len(sessions):
        live = [i for i in range(len(sessions)) if i not in done]
        outcomes = stage.step_sessions([(sessions[i], chunks[i]) for i in live])
        for i, outcome in zip(live, outcomes, strict=True):
            chunks[i] = []
            made = outputs[i]
            if isinstance(outcome, Exception):
                outputs[i] = outcome
                done.add(i)
                continue
            assert isinstance(outcome, StepResult), outcome
            assert not isinstance(made, Exception)
            made += outcome.outputs
            if outcome.done:
                done.add(i)
    return outputs


def samples(outputs: Sequence[dict[str, Any]]) -> np.ndarray:
    """The int16 samples of a session's streamed audio outputs, joined."""
    return np.concatenate([np.frombuffer(base64.b64decode(o["audio"]), "<i2") for o in outputs])
