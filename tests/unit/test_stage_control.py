"""A worker's control calls (worker/control.py) on a running StageRuntime: pause in its two
modes, sleep at both levels with the wake a request brings, the profiler, and the
refusals of what a stage cannot do."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from omnipipe.api.spec import Role
from omnipipe.api.wire import StageEvent, SubmitRequest
from omnipipe.stagekit.stage import StageJob, StageResult, SteppedStage
from omnipipe.transfer import Mailbox, Message, make_sender
from omnipipe.worker.control import ControlRefused, StageControl
from omnipipe.worker.jobs import Job
from omnipipe.worker.metrics import WorkerMetrics
from omnipipe.worker.profiler import ProfileLimits
from omnipipe.worker.runtime import StageRuntime
from tests.unit.test_batching import until
from tests.unit.test_omni_stages import spec

pytestmark = pytest.mark.timeout(60)


class Matmuls(SteppedStage):
    """Each request takes `steps` steps, each a small matmul and 20 ms."""

    loads = 0

    def __init__(self) -> None:
        super().__init__(spec("denoise", Role.DENOISER), "unused", "cpu")
        self.log: list[list[str]] = []

    def load(self) -> None:
        type(self).loads += 1
        self.weight = torch.nn.Linear(64, 64)

    def batch_key(self, job: StageJob) -> Hashable | None:
        return "all"

    def begin(self, job: StageJob) -> list[Any]:
        return [job.params["id"], int(job.params["steps"])]

    def step(self, states: Sequence[list[Any]]) -> None:
        self.log.append([s[0] for s in states])
        with torch.inference_mode():
            self.weight(torch.ones(len(states), 64))
        time.sleep(0.02)
        for s in states:
            s[1] -= 1

    def finished(self, state: list[Any]) -> bool:
        return bool(state[1] <= 0)

    def finish(self, state: list[Any]) -> StageResult:
        return StageResult(outputs=[{"id": state[0]}])


class Scene:
    def __init__(self, tmp: Path, settle_seconds: float = 10.0) -> None:
        self.stage = Matmuls()
        self.stage.load()
        metrics = WorkerMetrics.create("p", "denoise")
        self.rt = StageRuntime("denoise", self.stage, Mailbox(), make_sender("tcp"), metrics, 8)
        self.rt.start()

        async def reload() -> Matmuls:
            stage = Matmuls()
            stage.load()
            return stage

        self.control = StageControl(
            "denoise", lambda: self.rt, reload, settle_seconds, tmp / "profiles"
        )

    def submit(self, rid: str, steps: int) -> Job:
        request = SubmitRequest(
            request_id=rid,
            params={"id": rid, "steps": steps},
            inputs=["encode"],
            timeout_seconds=30,
        )
        job = self.rt.submit(request)
        return job

    async def deliver(self, rid: str) -> None:
        await self.rt.mailbox.put(Message(rid, "encode", {"x": torch.zeros(1)}))

    def steps_of(self, rid: str) -> int:
        stage = self.rt.stage
        assert isinstance(stage, Matmuls)
        return sum(rows.count(rid) for rows in stage.log)


async def last_event(job: Job) -> StageEvent:
    async with asyncio.timeout(20):
        while True:
            event = await job.events.get()
            if event.type in ("done", "error"):
                return event


async def test_pause_wait_lets_the_admitted_finish_and_holds_the_new(tmp_path: Path) -> None:
    scene = Scene(tmp_path)
    first = scene.submit("a", 10)
    await scene.deliver("a")
    await until("a to step", lambda: scene.steps_of("a") >= 1)
    answer = await scene.control.pause("wait")
    # The pause returns once the admitted request is done, all ten steps of it.
    assert (answer["paused"], answer["running"], answer["aborted"]) == (True, 0, 0)
    assert scene.steps_of("a") == 10
    assert (await last_event(first)).type == "done"
    held = scene.submit("b", 2)
    await scene.deliver("b")
    await asyncio.sleep(0.3)
    assert scene.steps_of("b") == 0
    assert not held.admitted
    await scene.control.resume()
    assert (await last_event(held)).type == "done"
    assert scene.steps_of("b") == 2
    await scene.rt.close()


async def test_pause_abort_ends_every_request_with_a_503_cause(tmp_path: Path) -> None:
    scene = Scene(tmp_path)
    running = scene.submit("a", 400)
    await scene.deliver("a")
    await until("a to step", lambda: scene.steps_of("a") >= 1)
    waiting = scene.submit("b", 2)  # its input never comes
    answer = await scene.control.pause("abort")
    assert (answer["aborted"], answer["running"]) == (2, 0)
    for job in (running, waiting):
        event = await last_event(job)
        assert (event.type, event.code) == ("error", "stage_unavailable")
        assert "generation paused" in event.message
    assert scene.steps_of("a") < 400
    # b was aborted before its task first ran: it left all the same.
    assert not scene.rt.jobs
    assert scene.control.state()["paused"]
    await scene.control.resume()
    after = scene.submit("c", 2)
    await scene.deliver("c")
    assert (await last_event(after)).type == "done"
    await scene.rt.close()


async def test_sleep_level_2_drops_the_stage_and_a_request_wakes_it(tmp_path: Path) -> None:
    scene = Scene(tmp_path)
    loads = Matmuls.loads
    answer = await scene.control.sleep(2)
    assert (answer["sleeping"], answer["sleep_level"]) == (True, 2)
    assert scene.rt.stage is None
    job = scene.submit("a", 3)
    await scene.deliver("a")
    assert (await last_event(job)).type == "done"
    assert Matmuls.loads == loads + 1  # reloaded once, by the request
    assert scene.rt.stage is not scene.stage
    assert scene.steps_of("a") == 3
    assert not scene.control.state()["sleeping"]
    await scene.rt.close()


async def test_one_wake_serves_every_request_even_one_that_gives_up(tmp_path: Path) -> None:
    scene = Scene(tmp_path)
    loaded = threading.Event()

    def load_when_let() -> Matmuls:
        loaded.wait(20)
        stage = Matmuls()
        stage.load()
        return stage

    async def slow_reload() -> Matmuls:
        # As the worker's: a load on a thread, which a cancelled caller does not stop.
        return await asyncio.to_thread(load_when_let)

    scene.control._reload = slow_reload
    loads = Matmuls.loads
    await scene.control.sleep(2)
    quitter = scene.submit("a", 2)
    stayer = scene.submit("b", 2)
    await scene.deliver("b")
    await until("the wake to start", lambda: scene.control._waking is not None)
    scene.rt.cancel("a")  # its client left while the stage reloads
    assert (await last_event(quitter)).code == "cancelled"
    loaded.set()
    assert (await last_event(stayer)).type == "done"
    assert Matmuls.loads == loads + 1
    assert not scene.control.state()["sleeping"]
    await scene.rt.close()


async def test_sleep_level_1_keeps_the_stage_and_wakes_up(tmp_path: Path) -> None:
    scene = Scene(tmp_path)
    answer = await scene.control.sleep(1)
    # On the CPU the weights are in host memory already: nothing to release.
    assert (answer["sleep_level"], answer["device"], answer["released_bytes"]) == (1, "cpu", 0)
    with pytest.raises(ControlRefused, match="asleep already"):
        await scene.control.sleep(2)
    await scene.control.wake_up()
    assert scene.rt.stage is scene.stage
    job = scene.submit("a", 2)
    await scene.deliver("a")
    assert (await last_event(job)).type == "done"
    await scene.rt.close()


async def test_sleep_waits_for_running_requests_and_refuses_past_its_limit(
    tmp_path: Path,
) -> None:
    scene = Scene(tmp_path, settle_seconds=0.2)
    job = scene.submit("a", 300)
    await scene.deliver("a")
    await until("a to step", lambda: scene.steps_of("a") >= 1)
    with pytest.raises(ControlRefused, match="1 requests still running"):
        await scene.control.sleep(2)
    # Refused, the stage takes requests as before.
    assert scene.rt.admitting.is_set()
    assert scene.rt.stage is scene.stage
    assert not scene.control.state()["sleeping"]
    other = scene.submit("b", 2)
    await scene.deliver("b")
    assert (await last_event(other)).type == "done"
    scene.rt.cancel("a")
    await last_event(job)
    await scene.rt.close()


async def test_a_profile_records_the_engine_threads_work(tmp_path: Path) -> None:
    scene = Scene(tmp_path)
    with pytest.raises(ControlRefused, match="not profiling"):
        await scene.control.stop_profile()
    await scene.control.start_profile()
    with pytest.raises(ControlRefused, match="profiling already"):
        await scene.control.start_profile()
    job = scene.submit("a", 3)
    await scene.deliver("a")
    assert (await last_event(job)).type == "done"
    answer = await scene.control.stop_profile()
    trace = Path(answer["trace"])
    assert trace.parent == tmp_path / "profiles"
    events = json.loads(await asyncio.to_thread(trace.read_text))["traceEvents"]
    names = {event.get("name") for event in events}
    assert "aten::linear" in names  # the stage's own matmul, run on the engine thread
    await scene.rt.close()


async def test_what_a_stage_cannot_do_is_refused(tmp_path: Path) -> None:
    scene = Scene(tmp_path)
    with pytest.raises(ControlRefused, match="keeps no prefix cache"):
        await scene.control.reset_cache("prefix")
    with pytest.raises(ControlRefused, match="has no tokenizer"):
        await scene.control.tokenizer_files()
    assert scene.rt.admitting.is_set()
    await scene.rt.close()


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        (ProfileLimits(max_seconds=0.5), "its time limit (0.5 s)"),
        (ProfileLimits(max_bytes=64 << 20), "its memory limit (64 MiB of growth)"),
    ],
    ids=["time", "memory"],
)
async def test_a_profile_left_running_stops_by_itself_and_keeps_its_trace(
    tmp_path: Path, limits: ProfileLimits, reason: str
) -> None:
    """A profile no one stops ends at its time limit, or once the process has grown by
    its memory limit (the profiler holds its events in host memory): its trace is written
    then, and the next stop call answers it with the reason."""
    scene = Scene(tmp_path)
    scene.control.profiler.limits = limits
    await scene.control.start_profile()
    job = scene.submit("a", 3)
    await scene.deliver("a")
    assert (await last_event(job)).type == "done"
    grown = bytearray(0)
    if limits.max_bytes < ProfileLimits().max_bytes:
        grown = bytearray(b"\1" * (96 << 20))  # the process grows; RSS shows it
    started = time.monotonic()
    while scene.control.state()["profiling"]:
        assert time.monotonic() - started < 20, "the profile did not stop by itself"
        await asyncio.sleep(0.05)
    del grown
    answer = await scene.control.stop_profile()
    assert answer["stopped_by"] == reason
    events = json.loads(await asyncio.to_thread(Path(answer["trace"]).read_text))["traceEvents"]
    assert "aten::linear" in {event.get("name") for event in events}
    with pytest.raises(ControlRefused, match="not profiling"):
        await scene.control.stop_profile()  # collected once
    await scene.rt.close()
