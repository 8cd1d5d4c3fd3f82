"""The engine watchdog: an engine call that makes no progress is seen, a slow one that
does is not, and the clock stops when the engine is idle."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from omnipipe.api import ResolvedStage
from omnipipe.api.loading import load_pipeline
from omnipipe.api.spec import Role
from omnipipe.api.wire import SubmitRequest
from omnipipe.stagekit.stage import Stage, StageJob, StageResult
from omnipipe.transfer import Mailbox, make_sender
from omnipipe.worker.metrics import WorkerMetrics
from omnipipe.worker.runtime import StageRuntime
from tests.unit.test_omni_stages import spec

pytestmark = pytest.mark.timeout(30)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples/tiny-text-to-image.yaml"


class Hanging(Stage):
    """Runs until released; calls progress() every `beat` seconds when beat > 0."""

    def __init__(self, stage: ResolvedStage, beat: float) -> None:
        super().__init__(stage, "unused", "cpu")
        self.beat = beat
        self.release = threading.Event()

    def load(self) -> None:
        pass

    def run(self, job: StageJob) -> StageResult:
        while not self.release.wait(self.beat if self.beat > 0 else 10):
            if self.beat > 0:
                self.progress()
        return StageResult()


async def watch(beat: float) -> tuple[float, float]:
    """Seconds without progress seen 0.6 s into a running call, and once it is done."""
    stage = Hanging(spec("denoise", Role.DENOISER), beat)
    runtime = StageRuntime(
        "denoise", stage, Mailbox(), make_sender("tcp"), WorkerMetrics.create("p", "denoise"), 1
    )
    runtime.start()
    job = runtime.submit(SubmitRequest(request_id="r1", params={}, timeout_seconds=20))
    await asyncio.sleep(0.6)
    during = runtime.seconds_without_progress()
    stage.release.set()
    assert job.task is not None
    await asyncio.wait_for(job.task, 10)
    after = runtime.seconds_without_progress()
    await runtime.close()
    return during, after


async def test_a_call_that_makes_no_progress_is_seen() -> None:
    during, after = await watch(beat=0)
    assert during >= 0.5
    assert after == 0.0


async def test_a_slow_call_that_reports_progress_is_not_stalled() -> None:
    during, after = await watch(beat=0.05)
    assert during < 0.3
    assert after == 0.0


async def test_ready_turns_false_while_the_engine_is_stalled_and_back_after() -> None:
    from omnipipe.worker.server import WorkerState
    from omnipipe.worker.settings import WorkerSettings

    pipeline = await asyncio.to_thread(load_pipeline, EXAMPLE)
    stage = Hanging(spec("denoise", Role.DENOISER), beat=0)
    metrics = WorkerMetrics.create(pipeline.name, "denoise")
    state = WorkerState(
        pipeline, WorkerSettings(stage="denoise", stall_seconds=0.3), metrics, loaded=True
    )
    state.runtime = StageRuntime("denoise", stage, Mailbox(), make_sender("tcp"), metrics, 1)
    state.runtime.start()
    assert state.status().ready
    job = state.runtime.submit(SubmitRequest(request_id="r1", params={}, timeout_seconds=20))
    await asyncio.sleep(0.6)
    stalled = state.status()
    assert not stalled.ready
    assert stalled.message.startswith("engine stalled: no progress for")
    stage.release.set()
    assert job.task is not None
    await asyncio.wait_for(job.task, 10)
    assert state.status().ready
    await state.runtime.close()
