"""Batching with an admission window (StageRuntime) and CPU thread budgets: a batch that
is not full waits, briefly, only for requests already sent whose inputs are on their way;
a lone request never waits; a request cancelled while the batch waited leaves it."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import pytest
import torch

from omnipipe.api.cpus import cores_of, split_cores, threads_for
from omnipipe.api.spec import Role
from omnipipe.api.wire import StageEvent, SubmitRequest
from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    Stage,
    StageInputError,
    StageJob,
    StageResult,
    StepOutcome,
    SteppedStage,
    StepResult,
    StreamingStage,
)
from omnipipe.transfer import Mailbox, Message, make_sender
from omnipipe.worker.metrics import WorkerMetrics
from omnipipe.worker.runtime import StageRuntime
from omnipipe.worker.threads import thread_budget
from tests.unit.test_omni_stages import spec

pytestmark = pytest.mark.timeout(30)


class Recording(Stage):
    """Batches everything with the same `k` param; records each engine call's batch."""

    def __init__(self) -> None:
        super().__init__(spec("denoise", Role.DENOISER), "unused", "cpu")
        self.batches: list[list[str]] = []
        self.lock = threading.Lock()

    def load(self) -> None:
        pass

    def batch_key(self, job: StageJob) -> Hashable | None:
        return job.params.get("k")

    def run(self, job: StageJob) -> StageResult:
        return self.run_batch([job])[0]

    def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
        with self.lock:
            self.batches.append([str(j.params["id"]) for j in jobs])
        time.sleep(0.05)
        return [StageResult() for _ in jobs]


def runtime(stage: Stage, wait_s: float, max_batch: int = 8) -> StageRuntime:
    metrics = WorkerMetrics.create("p", "denoise")
    rt = StageRuntime("denoise", stage, Mailbox(), make_sender("tcp"), metrics, max_batch, wait_s)
    rt.start()
    return rt


def request(rid: str, k: str | None = "same") -> SubmitRequest:
    return SubmitRequest(
        request_id=rid, params={"id": rid, "k": k}, inputs=["encode"], timeout_seconds=20
    )


async def deliver(rt: StageRuntime, rid: str) -> None:
    await rt.mailbox.put(Message(rid, "encode", {"x": torch.zeros(1)}))


async def until(what: str, check: Callable[[], bool]) -> None:
    """Wait for a state rather than a time: a loaded machine stretches any sleep."""
    try:
        async with asyncio.timeout(10):
            while not check():  # noqa: ASYNC110 - the state changes on the engine thread
                await asyncio.sleep(0.002)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def finish(rt: StageRuntime, rids: list[str]) -> None:
    tasks = [t for rid in rids if (t := TASKS[id(rt), rid]) is not None]
    await asyncio.wait_for(asyncio.gather(*tasks), 10)


TASKS: dict[tuple[int, str], asyncio.Task[None] | None] = {}


def submit(rt: StageRuntime, req: SubmitRequest) -> None:
    TASKS[id(rt), req.request_id] = rt.submit(req).task


async def test_requests_on_their_way_join_a_batch_that_waits_for_them() -> None:
    stage = Recording()
    rt = runtime(stage, wait_s=1.0)
    ids = ["a", "b", "c"]
    for rid in ids:
        submit(rt, request(rid))
    for rid in ids:  # inputs arrive 50 ms apart, as encodes finishing one by one
        await deliver(rt, rid)
        await asyncio.sleep(0.05)
    await finish(rt, ids)
    await rt.close()
    assert stage.batches == [ids]


async def test_without_a_window_only_what_is_queued_runs_together() -> None:
    stage = Recording()
    rt = runtime(stage, wait_s=0.0)
    ids = ["a", "b", "c"]
    for rid in ids:
        submit(rt, request(rid))
    # Each arrives once the one before is running: none was queued when a batch began.
    for n, rid in enumerate(ids, 1):
        await deliver(rt, rid)
        await until(f"{rid} to run", lambda: len(stage.batches) == n)  # noqa: B023 - awaited here
    await finish(rt, ids)
    await rt.close()
    assert stage.batches == [["a"], ["b"], ["c"]]


async def test_a_lone_request_never_waits_for_the_window() -> None:
    stage = Recording()
    rt = runtime(stage, wait_s=5.0)
    submit(rt, request("a"))
    started = time.monotonic()
    await deliver(rt, "a")
    await finish(rt, ["a"])
    took = time.monotonic() - started
    await rt.close()
    assert stage.batches == [["a"]]
    assert took < 1.0


async def test_the_window_is_bounded_and_the_batch_by_max_batch() -> None:
    stage = Recording()
    rt = runtime(stage, wait_s=0.2, max_batch=2)
    for rid in ("a", "b", "c", "late"):
        submit(rt, request(rid))
    for rid in ("a", "b", "c"):
        await deliver(rt, rid)
    started = time.monotonic()
    await finish(rt, ["a", "b", "c"])
    # "late" never gets its inputs: the batches after the first do not wait past 0.2 s.
    assert time.monotonic() - started < 2.0
    assert stage.batches == [["a", "b"], ["c"]]
    rt.cancel("late")
    await rt.close()


async def test_incompatible_requests_never_share_a_batch() -> None:
    stage = Recording()
    rt = runtime(stage, wait_s=0.5)
    submit(rt, request("a", k="x"))
    submit(rt, request("b", k="y"))
    submit(rt, request("c", k=None))
    submit(rt, request("d", k=None))
    for rid in ("a", "b", "c", "d"):
        await deliver(rt, rid)
    await finish(rt, ["a", "b", "c", "d"])
    await rt.close()
    assert sorted(stage.batches) == [["a"], ["b"], ["c"], ["d"]]


async def test_a_request_cancelled_while_the_batch_waits_leaves_it() -> None:
    stage = Recording()
    rt = runtime(stage, wait_s=0.5)
    for rid in ("a", "b", "c"):
        submit(rt, request(rid))
    await deliver(rt, "a")
    await deliver(rt, "b")
    await asyncio.sleep(0.1)  # a and b wait in the window for c
    rt.cancel("b")
    await deliver(rt, "c")
    await finish(rt, ["a", "c"])
    await rt.close()
    assert stage.batches == [["a", "c"]]


class Steps(SteppedStage):
    """Each request takes `steps` steps of 30 ms; every step's rows are recorded."""

    def __init__(self) -> None:
        super().__init__(spec("denoise", Role.DENOISER), "unused", "cpu")
        self.log: list[list[str]] = []

    def load(self) -> None:
        pass

    def batch_key(self, job: StageJob) -> Hashable | None:
        return job.params.get("k")

    def begin(self, job: StageJob) -> list[Any]:
        return [job.params["id"], int(job.params.get("steps", 5))]

    def step(self, states: Sequence[list[Any]]) -> None:
        self.log.append([s[0] for s in states])
        time.sleep(0.03)
        for s in states:
            s[1] -= 1

    def finished(self, state: list[Any]) -> bool:
        return bool(state[1] <= 0)

    def finish(self, state: list[Any]) -> StageResult:
        return StageResult(outputs=[{"id": state[0]}])


def stepped(rid: str, steps: int, k: str | None = "same") -> SubmitRequest:
    return SubmitRequest(
        request_id=rid,
        params={"id": rid, "k": k, "steps": steps},
        inputs=["encode"],
        timeout_seconds=20,
    )


async def test_a_request_joins_a_running_batch_at_a_step_boundary() -> None:
    stage = Steps()
    rt = runtime(stage, wait_s=0.0)
    submit(rt, stepped("a", 40))
    await deliver(rt, "a")
    await until("a to be a few steps in", lambda: len(stage.log) >= 2)
    submit(rt, stepped("b", 3))
    await deliver(rt, "b")
    await finish(rt, ["a", "b"])
    await rt.close()
    together = [i for i, rows in enumerate(stage.log) if rows == ["a", "b"]]
    assert len(together) == 3, stage.log  # b's three steps all ran beside a's
    assert stage.log[0] == ["a"]
    assert stage.log[together[-1] + 1 :] == [["a"]] * (40 - together[-1] - 1)
    assert sum(rows.count("a") for rows in stage.log) == 40


async def test_the_request_steps_a_stage_counts_reach_the_workers_metrics() -> None:
    class Counting(Steps):
        def step(self, states: Sequence[list[Any]]) -> None:
            super().step(states)
            self.count_steps("computed", len(states))

    stage = Counting()
    rt = runtime(stage, wait_s=0.0)
    submit(rt, stepped("a", 3))
    await deliver(rt, "a")
    await finish(rt, ["a"])
    await rt.close()
    counted = rt.metrics.registry.get_sample_value(
        "omnipipe_stage_denoise_steps_total",
        {"pipeline": "p", "stage": "denoise", "kind": "computed"},
    )
    assert counted == 3


async def test_a_request_that_asks_hears_each_of_its_steps() -> None:
    """SubmitRequest.progress: an event after each of the request's steps (what a video
    job's percent is made of); a request that does not ask hears none."""

    class Counted(Steps):
        def step_count(self, state: list[Any]) -> tuple[int, int] | None:
            return int(state[2]) - int(state[1]), int(state[2])

        def begin(self, job: StageJob) -> list[Any]:
            steps = int(job.params["steps"])
            return [job.params["id"], steps, steps]

    rt = runtime(Counted(), wait_s=0.0)
    asked = stepped("a", 3).model_copy(update={"progress": True})
    jobs = [rt.submit(asked), rt.submit(stepped("b", 3))]
    await deliver(rt, "a")
    await deliver(rt, "b")
    await asyncio.wait_for(asyncio.gather(*(j.task for j in jobs if j.task)), 10)
    await rt.close()
    heard: list[list[Any]] = [[], []]
    for job, events in zip(jobs, heard, strict=True):
        while not job.events.empty():
            events.append(job.events.get_nowait())
    assert [e.data for e in heard[0] if e.type == "progress"] == [
        {"step": 1, "steps": 3},
        {"step": 2, "steps": 3},
        {"step": 3, "steps": 3},
    ]
    assert [e.type for e in heard[0]][-1] == "done"
    assert [e.type for e in heard[1] if e.type == "progress"] == []


class StepsTogether(Steps):
    """A stepped stage whose batch runs its steps together, none joining (a step cache)."""

    @property
    def joins_between_steps(self) -> bool:
        return False


async def test_a_batch_that_steps_together_takes_no_one_in_until_it_is_done() -> None:
    stage = StepsTogether()
    rt = runtime(stage, wait_s=0.0)
    submit(rt, stepped("a", 20))
    await deliver(rt, "a")
    await until("a to be a few steps in", lambda: len(stage.log) >= 2)
    submit(rt, stepped("b", 3))
    await deliver(rt, "b")
    await until("b to be queued", lambda: rt.queued == 1)
    # b waits while a still has steps to go: had it joined, it would step beside a.
    assert len(stage.log) < 20
    await finish(rt, ["a", "b"])
    await rt.close()
    assert stage.log == [["a"]] * 20 + [["b"]] * 3


async def test_a_request_whose_client_left_leaves_at_the_next_step() -> None:
    stage = Steps()
    rt = runtime(stage, wait_s=0.0)
    submit(rt, stepped("a", 20))
    submit(rt, stepped("b", 20))
    await deliver(rt, "a")
    await deliver(rt, "b")
    await until("b to step", lambda: any("b" in rows for rows in stage.log))
    rt.cancel("b")
    await finish(rt, ["a"])
    await rt.close()
    assert sum(rows.count("a") for rows in stage.log) == 20  # a went on to its end
    assert 1 <= sum(rows.count("b") for rows in stage.log) < 20, stage.log
    last_b = max(i for i, rows in enumerate(stage.log) if "b" in rows)
    assert all(rows == ["a"] for rows in stage.log[last_b + 1 :])


async def test_an_incompatible_request_waits_for_the_batch_to_drain() -> None:
    stage = Steps()
    rt = runtime(stage, wait_s=0.0)
    submit(rt, stepped("a", 4, k="x"))
    await deliver(rt, "a")
    await asyncio.sleep(0.05)
    submit(rt, stepped("b", 2, k="y"))
    submit(rt, stepped("c", 2, k="x"))
    await deliver(rt, "b")
    await deliver(rt, "c")
    await finish(rt, ["a", "b", "c"])
    await rt.close()
    # c is compatible with a but queued behind b: it does not overtake b.
    assert not any("b" in rows and "a" in rows for rows in stage.log)
    first_b = min(i for i, rows in enumerate(stage.log) if "b" in rows)
    assert all("c" not in rows for rows in stage.log[:first_b]), stage.log


class Preparing(StreamingStage):
    """A "heavy" request's prepare (decoding its media) lasts until the open "light"
    session has taken 5 more steps, or 5 s: on the engine thread it would get none."""

    def __init__(self) -> None:
        super().__init__(spec("thinker", Role.THINKER), "unused", "cpu")
        self.steps: list[str] = []
        self.prepared_on: list[str] = []
        self.light_stepped = threading.Event()
        self.steps_at_prepare: int | None = None

    def load(self) -> None:
        pass

    def prepare(self, job: StageJob) -> None:
        self.prepared_on.append(threading.current_thread().name)
        if job.params["id"] == "heavy":
            self.steps_at_prepare = self.steps.count("light")
            self.light_stepped.wait(5)
        job.prepared = job.params["id"]

    def open(self, job: StageJob) -> Session:
        stage = self

        class Ticking(Session):
            left = 40

            def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
                stage.steps.append(job.prepared)
                since = stage.steps_at_prepare
                if since is not None and stage.steps.count("light") >= since + 5:
                    stage.light_stepped.set()
                time.sleep(0.02)
                self.left -= 1
                return StepResult(done=self.left == 0)

            def close(self) -> None:
                pass

        return Ticking()


async def test_a_request_prepares_beside_the_engine_while_others_step() -> None:
    stage = Preparing()
    rt = runtime(stage, wait_s=0.0)
    submit(rt, SubmitRequest(request_id="light", params={"id": "light"}, timeout_seconds=20))
    await until("light to step", lambda: "light" in stage.steps)
    submit(rt, SubmitRequest(request_id="heavy", params={"id": "heavy"}, timeout_seconds=20))
    await finish(rt, ["light", "heavy"])
    await rt.close()
    assert stage.light_stepped.is_set(), "the light request's steps stopped while heavy prepared"
    assert all(name.startswith("prepare_") for name in stage.prepared_on), stage.prepared_on


class SlowDecode(Preparing):
    """The "heavy" request's prepare (a long decode) lasts until the "light" request,
    sent after it, has stepped, or 5 s."""

    def prepare(self, job: StageJob) -> None:
        self.prepared_on.append(threading.current_thread().name)
        if job.params["id"] == "heavy":
            self.steps_at_prepare = 0
            self.light_stepped.wait(5)
        job.prepared = job.params["id"]


async def test_a_request_sent_after_a_long_decode_prepares_and_steps_meanwhile() -> None:
    """A chat sent while another request's media decodes (a large clip, within its
    limits) prepares on another thread and gets its steps: it does not queue behind it."""
    stage = SlowDecode()
    rt = runtime(stage, wait_s=0.0)
    started = time.monotonic()
    submit(rt, SubmitRequest(request_id="heavy", params={"id": "heavy"}, timeout_seconds=20))
    await until("heavy to start preparing", lambda: stage.steps_at_prepare is not None)
    submit(rt, SubmitRequest(request_id="light", params={"id": "light"}, timeout_seconds=20))
    await until("light to step 5 times", lambda: stage.light_stepped.is_set())
    assert time.monotonic() - started < 4, "the light request waited for the heavy decode"
    assert "heavy" not in stage.steps  # still preparing when light stepped
    await finish(rt, ["light", "heavy"])
    await rt.close()
    assert len(set(stage.prepared_on)) == 2, stage.prepared_on


class Gathering(StreamingStage):
    """Sessions of `steps` steps each; records how many sessions each engine call stepped
    and every session's steps and close, in order."""

    def __init__(self, steps: int) -> None:
        super().__init__(spec("code2wav", Role.CODE2WAV), "unused", "cpu")
        self.calls: list[int] = []
        self.log: list[str] = []
        self.steps = steps
        self.hold_a = threading.Event()
        self.hold_a.set()
        self.holding = threading.Event()

    def load(self) -> None:
        pass

    def step_sessions(self, work: Sequence[tuple[Session, Sequence[Chunk]]]) -> list[StepOutcome]:
        self.calls.append(len(work))
        if any(getattr(session, "rid", "") == "a" for session, _ in work):
            self.holding.set()
            self.hold_a.wait(5)  # a test holds the call stepping "a" by clearing hold_a
            self.holding.clear()
        time.sleep(0.05)
        return super().step_sessions(work)

    def open(self, job: StageJob) -> Session:
        stage, rid = self, str(job.params["id"])

        class Counting(Session):
            left = self.steps
            rid = str(job.params["id"])

            def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
                stage.log.append(f"step {rid}")
                if rid == "bad":
                    raise ValueError("bad codes")
                self.left -= 1
                return StepResult(done=self.left == 0)

            def close(self) -> None:
                stage.log.append(f"close {rid}")

        return Counting()


async def test_open_sessions_waiting_to_step_are_stepped_in_one_engine_call() -> None:
    """Four streams started together: after the first call, every call steps all the
    sessions then waiting (four, not one at a time); one session's error is its own."""
    stage = Gathering(steps=5)
    rt = runtime(stage, wait_s=0.0)
    rids = ["a", "b", "c", "d"]
    for rid in rids:
        submit(rt, SubmitRequest(request_id=rid, params={"id": rid}, timeout_seconds=20))
    bad = rt.submit(SubmitRequest(request_id="bad", params={"id": "bad"}, timeout_seconds=20))
    await finish(rt, rids)
    assert bad.task is not None
    await asyncio.wait_for(bad.task, 10)
    await rt.close()
    assert max(stage.calls) == 5, stage.calls
    assert sum(stage.calls) == 4 * 5 + 1
    assert len(stage.calls) <= 7, stage.calls  # 21 steps in 5 or 6 calls, not 21
    assert bad.error == "stage_error"
    assert [e for e in stage.log if e.endswith("bad")] == ["step bad", "close bad"]


async def test_a_call_steps_at_most_max_batch_sessions_first_come_first_stepped() -> None:
    stage = Gathering(steps=3)
    rt = runtime(stage, wait_s=0.0, max_batch=2)
    rids = ["a", "b", "c", "d", "e"]
    for rid in rids:
        submit(rt, SubmitRequest(request_id=rid, params={"id": rid}, timeout_seconds=20))
    await finish(rt, rids)
    await rt.close()
    assert max(stage.calls) == 2, stage.calls
    assert sum(stage.calls) == 5 * 3
    steps = [e.split()[1] for e in stage.log if e.startswith("step")]
    # Round-robin in the order they came: none waits two calls while another steps twice.
    for rid in rids:
        at = [i for i, r in enumerate(steps) if r == rid]
        assert all(b - a <= len(rids) for a, b in itertools.pairwise(at)), steps


async def test_a_stream_cancelled_before_its_step_is_taken_is_never_stepped_again() -> None:
    """One session a call: while the call stepping "a" is held on the engine thread, "b"
    waits for the next call and is cancelled there. Its close runs after the held call;
    the next call must leave it out, or it would step a closed session."""
    stage = Gathering(steps=1000)
    rt = runtime(stage, wait_s=0.0, max_batch=1)
    submit(rt, SubmitRequest(request_id="a", params={"id": "a"}, timeout_seconds=20))
    submit(rt, SubmitRequest(request_id="b", params={"id": "b"}, timeout_seconds=20))
    await until("both to step", lambda: "step b" in stage.log and "step a" in stage.log)
    stage.hold_a.clear()
    await until("a call stepping a to be held", stage.holding.is_set)
    await asyncio.sleep(0.05)  # b, stepped in the call before, is back and waiting
    assert rt.cancel("b")
    await asyncio.sleep(0.05)
    stage.hold_a.set()
    await until("b to close", lambda: "close b" in stage.log)
    steps_of_a = stage.log.count("step a")
    await until("a to step on", lambda: stage.log.count("step a") > steps_of_a + 3)
    await rt.close()
    closed = stage.log.index("close b")
    assert "step b" not in stage.log[closed:], stage.log


def test_cpu_quantities_become_threads() -> None:
    assert cores_of(None) is None
    assert cores_of("500m") == 0.5
    assert cores_of("2") == 2.0
    assert cores_of(3) == 3.0
    assert [threads_for(c) for c in (0.25, 1.0, 1.5, 16)] == [1, 1, 2, 16]
    for bad in ("", "abc", "0", "-1", "1Gi"):
        with pytest.raises(ValueError, match="CPU quantity"):
            cores_of(bad)


def test_a_machine_is_split_evenly_with_at_least_one_thread_each() -> None:
    assert split_cores(2, {"encode": 1, "denoise": 1, "decode": 1}) == {
        "encode": 1,
        "denoise": 1,
        "decode": 1,
    }
    assert split_cores(16, {"encode": 1, "denoise": 2, "decode": 1}) == {
        "encode": 4,
        "denoise": 4,
        "decode": 4,
    }
    assert split_cores(8, {}) == {}


def test_the_thread_budget_prefers_the_launcher_then_the_stage_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from omnipipe.api.cpus import usable_cpus

    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert thread_budget(3, "8") == 3
    assert thread_budget(None, "8") == 5  # the stage's env said so
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert thread_budget(3, "8") == 3
    assert thread_budget(None, "500m") == 1
    assert thread_budget(None, "1024") == usable_cpus()
    assert thread_budget(None, None) == usable_cpus()
    assert thread_budget(None, "1Gi") == usable_cpus()  # no CPU quantity: warned, ignored


IMAGE_MANIFEST = """
apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: img}
spec: {model: "tiny://qwen-image", pipeline: qwen-image}
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("per_length", [False, True], ids=["padded", "forward-per-length"])
@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
def test_prompts_of_different_lengths_share_a_step_and_equal_running_alone(
    cfg: bool, per_length: bool
) -> None:
    """Padded and masked in one forward (the CPU's way), or one unmasked forward per text
    length (a GPU's): either way a batch equals its requests run alone, and diffusers."""
    import yaml
    from diffusers import QwenImagePipeline

    from omnipipe.api import parse_resource, resolve
    from omnipipe.checkpoints.tiny import resolve_model_path
    from omnipipe.worker.stage_classes import stage_class

    path = resolve_model_path("tiny://qwen-image")
    pipeline = resolve(parse_resource(yaml.safe_load(IMAGE_MANIFEST)))
    stages = {}
    for s in pipeline.stages[:2]:
        stages[s.name] = stage_class(s, path)(s, path, "cpu")
        stages[s.name].load()
    base = {"width": 64, "height": 64, "num_inference_steps": 3, "guidance_scale": 4.0}
    if cfg:
        base["negative_prompt"] = "blurry"
    # The first and last of one length, the middle longer: a length's rows are not
    # adjacent, so a forward per length must put its predictions back in row order.
    prompts = ["a cat", "a lighthouse on a cliff at dusk, oil painting, warm light", "a dog"]
    params = [{**base, "prompt": p, "seed": 7 + i} for i, p in enumerate(prompts)]
    encoded = [stages["encode"].run(StageJob(p, {})).tensors for p in params]
    lengths = {e["prompt_embeds"].shape[1] for e in encoded}
    assert len(lengths) == 2, "the prompts should tokenize to different lengths"
    jobs = [StageJob(p, {"encode": e}) for p, e in zip(params, encoded, strict=True)]
    denoise = stages["denoise"]
    assert denoise.forward_per_text_length is False  # the CPU's default
    denoise.forward_per_text_length = per_length
    assert denoise.batch_key(jobs[0]) == denoise.batch_key(jobs[1])
    alone = [denoise.run_batch([j])[0].tensors["latents"] for j in jobs]
    forwards: list[int] = []
    hook = denoise.pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, out: forwards.append(len(kwargs["hidden_states"])),
        with_kwargs=True,
    )
    together = [r.tensors["latents"] for r in denoise.run_batch(jobs)]
    hook.remove()
    texts = [e["prompt_embeds"].shape[1] for e in encoded]
    if cfg:  # both requests share the negative prompt: one more length, two more rows
        texts.append(encoded[0]["negative_prompt_embeds"].shape[1])
    groups = len(set(texts)) if per_length else 1
    assert len(forwards) == 3 * groups  # three steps
    assert sum(forwards) == 3 * (6 if cfg else 3)  # every row, once a step
    for a, t in zip(alone, together, strict=True):
        torch.testing.assert_close(t, a, rtol=1e-4, atol=1e-4)
    # The fence: one prompt alone equals diffusers' whole pipeline.
    pipe: Any = QwenImagePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        expected = pipe(
            prompt=prompts[1],
            negative_prompt=base.get("negative_prompt"),
            true_cfg_scale=4.0 if cfg else 1.0,
            height=64,
            width=64,
            num_inference_steps=3,
            generator=torch.Generator().manual_seed(8),
            output_type="latent",
        ).images
    torch.testing.assert_close(together[1], expected, rtol=1e-4, atol=1e-4)


async def test_a_one_shot_stage_that_steps_itself_reports_each_step_to_who_asks() -> None:
    """StageJob.on_step (a whole diffusers pipeline's step callback, on the engine thread)
    becomes the asking request's progress events, in order and before its result; a
    request that does not ask hears none."""

    class Looping(Recording):
        def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
            for step in range(1, 4):
                for job in jobs:
                    job.on_step(step, 3)
            return [StageResult() for _ in jobs]

    rt = runtime(Looping(), wait_s=0.0)
    asked = request("a").model_copy(update={"progress": True})
    jobs = [rt.submit(asked), rt.submit(request("b"))]
    await deliver(rt, "a")
    await deliver(rt, "b")
    await asyncio.wait_for(asyncio.gather(*(j.task for j in jobs if j.task)), 10)
    await rt.close()
    heard: list[list[Any]] = [[], []]
    for job, events in zip(jobs, heard, strict=True):
        while not job.events.empty():
            events.append(job.events.get_nowait())
    assert [e.data for e in heard[0] if e.type == "progress"] == [
        {"step": step, "steps": 3} for step in (1, 2, 3)
    ]
    assert [e.type for e in heard[0]][-1] == "done"
    assert [e.type for e in heard[1] if e.type == "progress"] == []


async def test_a_request_whose_input_a_batch_refuses_fails_alone() -> None:
    """A whole pipeline's call refuses a batch when one request's input is bad (diffusers'
    check_inputs, an undecodable image): that request gets its 400, the others in the
    call their results, not another client's error."""

    class Refusing(Recording):
        def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
            super().run_batch(jobs)
            if any(job.params["id"] == "bad" for job in jobs):
                raise StageInputError("image: not a decodable image", "image")
            return [StageResult(outputs=[{"id": job.params["id"]}]) for job in jobs]

    stage = Refusing()
    rt = runtime(stage, wait_s=0.5)
    jobs = {rid: rt.submit(request(rid)) for rid in ("a", "bad", "c")}
    for rid in jobs:
        await deliver(rt, rid)
    await asyncio.wait_for(asyncio.gather(*(j.task for j in jobs.values() if j.task)), 10)
    await rt.close()
    assert stage.batches[0] == ["a", "bad", "c"]  # one call, refused
    assert sorted(map(tuple, stage.batches[1:])) == [("a",), ("bad",), ("c",)]
    ends: dict[str, StageEvent] = {}
    for rid, job in jobs.items():
        while not job.events.empty():
            ends[rid] = job.events.get_nowait()
    assert (ends["bad"].type, ends["bad"].param) == ("error", "image")
    assert [ends[r].type for r in ("a", "c")] == ["done", "done"]
