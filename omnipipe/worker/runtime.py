"""Request lifecycle inside one worker: admit, hand to the stage kind's scheduler,
report. The runtime owns what every kind shares (the pause gate, cancellation, errors,
load accounting, the engine thread); the scheduler, picked when a stage is loaded, owns
how a request reaches the engine (scheduling/).

Everything here runs on the event loop except the engine call, which runs on one
dedicated thread so the loop keeps serving transfers and health checks meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from opentelemetry import trace

from omnipipe.api.param_limits import ParamLimit
from omnipipe.api.wire import StageEvent, SubmitRequest
from omnipipe.stagekit.stage import Stage, StageInputError, SteppedStage, StreamingStage
from omnipipe.transfer import Mailbox, Sender, TransferRefused
from omnipipe.transfer.handoffs import HandOffs
from omnipipe.worker import tracing
from omnipipe.worker.engine_thread import EngineThread
from omnipipe.worker.inputs import StageInputs
from omnipipe.worker.jobs import Job
from omnipipe.worker.metrics import WorkerMetrics
from omnipipe.worker.scheduling.base import Host, Scheduler
from omnipipe.worker.scheduling.one_shot import OneShotScheduler
from omnipipe.worker.scheduling.stepped import SteppedScheduler
from omnipipe.worker.scheduling.streaming import StreamingScheduler

log = logging.getLogger(__name__)
T = TypeVar("T")


class DuplicateRequest(Exception):
    pass


async def _set_within(event: asyncio.Event, limit_seconds: float) -> bool:
    """Waits for the event; False if it is still unset after the limit."""
    try:
        await asyncio.wait_for(event.wait(), limit_seconds)
    except TimeoutError:
        return False
    return True


def scheduler_for(stage: Stage, host: Host) -> Scheduler:
    """The scheduler of the stage's kind."""
    if isinstance(stage, SteppedStage):
        return SteppedScheduler(stage, host)
    if isinstance(stage, StreamingStage):
        return StreamingScheduler(stage, host)
    return OneShotScheduler(stage, host)


class StageRuntime:
    def __init__(
        self,
        stage_name: str,
        stage: Stage | None,
        mailbox: Mailbox,
        sender: Sender,
        metrics: WorkerMetrics,
        max_batch: int,
        batch_wait_seconds: float = 0.0,
        tracer: trace.Tracer | None = None,
        threads: int | None = None,
    ) -> None:
        self.stage_name = stage_name
        self.tracer = tracer or trace.NoOpTracer()
        self._stage = stage
        self.mailbox = mailbox
        self.sender = sender
        # Every request's chunks for one destination in one transport message per turn
        # of the loop: a step of 16 sessions sends one batch per talker replica (#25).
        self.handoffs = HandOffs(sender)
        self.metrics = metrics
        self.jobs: dict[str, Job] = {}
        self.param_limits: tuple[ParamLimit, ...] = ()
        self._engine = EngineThread(threads)
        self._inputs = StageInputs(mailbox, self._engine)
        self._host = Host(
            stage_name,
            self.jobs,
            self._engine,
            self._inputs,
            self.handoffs,
            metrics,
            max_batch,
            batch_wait_seconds,
            self._update_load,
        )
        self._scheduler: Scheduler | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        # Cleared while generation is paused: requests that arrive wait, those admitted
        # before go on (worker/control.py). Read it here; pause_admission and
        # resume_admission change it.
        self.admitting = asyncio.Event()
        self.admitting.set()
        self._none_admitted = asyncio.Event()
        self._none_admitted.set()
        # Called before a request's work starts: wakes a sleeping stage (control.py).
        self._before_work: Callable[[], Awaitable[None]] | None = None

    @property
    def stage(self) -> Stage | None:
        """The loaded stage; None before load() and while it sleeps at level 2."""
        return self._stage

    # ---- load accounting -------------------------------------------------------------
    @property
    def running(self) -> int:
        return sum(1 for j in self.jobs.values() if j.running)

    @property
    def waiting(self) -> int:
        return len(self.jobs) - self.running

    @property
    def admitted(self) -> int:
        """Requests past the pause gate and not yet done: a pause waits for these."""
        return sum(1 for j in self.jobs.values() if j.admitted)

    @property
    def queued(self) -> int:
        """Requests whose inputs are in, waiting in the queue for the engine."""
        return self._scheduler.queued if self._scheduler is not None else 0

    def _update_load(self) -> None:
        self.metrics.set_load(self.running, self.waiting)
        if self.jobs:
            self._idle.clear()
        else:
            self._idle.set()
        if self.admitted:
            self._none_admitted.clear()
        else:
            self._none_admitted.set()

    async def wait_none_admitted(self, limit_seconds: float) -> bool:
        """Until no admitted request is left (False: still some after the limit)."""
        return await _set_within(self._none_admitted, limit_seconds)

    async def wait_idle(self, limit_seconds: float) -> bool:
        return await _set_within(self._idle, limit_seconds)

    # ---- the pause gate ----------------------------------------------------------------
    def pause_admission(self) -> None:
        """Requests that arrive from now wait at the gate; those admitted before go on."""
        self.admitting.clear()

    def resume_admission(self) -> None:
        self.admitting.set()

    def set_before_work(self, hook: Callable[[], Awaitable[None]] | None) -> None:
        """What every request awaits at the gate before its work starts (None: nothing)."""
        self._before_work = hook

    async def _pass_the_gate(self, job: Job) -> None:
        while True:
            await self.admitting.wait()
            if self._before_work is not None:
                await self._before_work()
            if self.admitting.is_set():  # not paused again meanwhile
                break
        job.admitted = True
        self._update_load()

    # ---- the engine thread -------------------------------------------------------------
    async def beside_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn on the preparation thread, the one other thread that uses the stage's
        processors (their tokenizers are not safe to share between threads)."""
        return await self._engine.beside(fn, *args)

    async def between_batches(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn on the engine thread, where no batch runs beside it (a LoRA change)."""
        return await self._engine.run(fn, *args)

    def seconds_without_progress(self) -> float:
        """How long the engine call now running has gone without progress; 0 when idle."""
        return self._engine.seconds_without_progress()

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Runs the stage given to the constructor: its kind's scheduler from now."""
        stage = self._stage
        if stage is None:
            return
        stage.progress = self._engine.progress
        stage.count_steps = self.metrics.count_steps
        self._scheduler = scheduler_for(stage, self._host)
        self._loop_task = asyncio.create_task(self._scheduler.run(), name="engine-loop")

    def load(self, stage: Stage) -> None:
        """Runs a stage loaded after the runtime was made (or reloaded on waking)."""
        self._stage = stage
        # Kept past a sleep at level 2, which lets the stage go: the model is the same.
        self.param_limits = tuple(stage.param_limits())
        self.start()

    async def unload(self) -> None:
        """Ends the engine loop and lets the stage go (nothing may be running: pause
        first), so load() can run another stage object (a stage woken from sleep)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self._scheduler = None
        self._stage = None

    async def close(self) -> None:
        for job in list(self.jobs.values()):
            if job.task:
                job.task.cancel()
        if self._loop_task:
            self._loop_task.cancel()
        await self.handoffs.close()
        self._engine.shutdown()

    def submit(self, request: SubmitRequest, traceparent: str = "") -> Job:
        if request.request_id in self.jobs:
            raise DuplicateRequest(request.request_id)
        job = Job(request, traceparent=traceparent)
        if request.inputs:
            # Inputs may arrive before the job first asks for them; claimed now, they are
            # never refused for the share a flood of unclaimed inputs may hold.
            self.mailbox.claim(request.request_id)
        self.jobs[request.request_id] = job
        job.task = asyncio.create_task(self._drive(job), name=f"job-{request.request_id}")
        job.task.add_done_callback(lambda _: self._end_unstarted(job))
        self._update_load()
        return job

    def _end_unstarted(self, job: Job) -> None:
        """A job whose task was cancelled before its first step never ran _drive's
        handlers: it still gets its error event, and leaves."""
        request_id = job.request.request_id
        if self.jobs.get(request_id) is not job:
            return  # _drive ended it
        job.error = "aborted" if job.aborted else "cancelled"
        job.events.put_nowait(self._cancel_event(job))
        self.mailbox.discard(request_id)
        del self.jobs[request_id]
        self._update_load()

    def _cancel_event(self, job: Job) -> StageEvent:
        if job.aborted:
            return StageEvent(
                type="error", code="stage_unavailable", message=f"{self.stage_name}: {job.aborted}"
            )
        return StageEvent(type="error", code="cancelled", message="cancelled")

    def cancel(self, request_id: str) -> bool:
        job = self.jobs.get(request_id)
        if job is None:
            self.mailbox.discard(request_id)
            return False
        if job.task:
            job.task.cancel()
        return True

    def abort_all(self, reason: str) -> int:
        """Ends every request this worker holds, each with `reason` as its error (the
        client's 503); how many."""
        for job in self.jobs.values():
            job.aborted = reason
            if job.task:
                job.task.cancel()
        return len(self.jobs)

    # ---- one request -------------------------------------------------------------------
    async def _serve(self, job: Job) -> list[dict[str, Any]]:
        if self._scheduler is None:
            raise RuntimeError(f"{self.stage_name} has no stage loaded")
        return await self._scheduler.serve(job)

    async def _drive(self, job: Job) -> None:
        request = job.request
        try:
            async with asyncio.timeout(request.timeout_seconds):
                await self._pass_the_gate(job)
                outputs = await self._serve(job)
            if request.emit:
                for i, output in enumerate(outputs):
                    await job.events.put(StageEvent(type="result", index=i, data=output))
            job.timeline.mark(tracing.DONE)
            done = {"usage": job.usage} if job.usage else {}
            await job.events.put(StageEvent(type="done", data=done))
            self.metrics.observe_duration(time.monotonic() - job.submitted)
        except asyncio.CancelledError:
            job.error = "aborted" if job.aborted else "cancelled"
            if job.stage_job is not None:
                job.stage_job.cancelled.set()
            await job.events.put(self._cancel_event(job))
        except TimeoutError:
            job.error = "timeout"
            # Stop the engine's work too: a denoising loop checks this between steps (a
            # streaming session is closed by its scheduler's finally).
            if job.stage_job is not None:
                job.stage_job.cancelled.set()
            await job.events.put(
                StageEvent(type="error", code="timeout", message=f"{self.stage_name} timed out")
            )
        except StageInputError as exc:
            job.error = "invalid_request"
            await job.events.put(exc.event())
        except TransferRefused as exc:
            job.error = "stage_unavailable"
            # The next stage refused the hand-off (its mailbox is full, or it is no peer):
            # the stage is unavailable for this request, not broken.
            await job.events.put(
                StageEvent(
                    type="error", code="stage_unavailable", message=f"{self.stage_name}: {exc}"
                )
            )
        except Exception as exc:
            job.error = "stage_error"
            log.exception("request %s failed in %s", request.request_id, self.stage_name)
            await job.events.put(
                StageEvent(type="error", code="stage_error", message=f"{self.stage_name}: {exc}")
            )
        finally:
            self._inputs.free_rows(request.request_id)
            self.mailbox.discard(request.request_id)
            self.jobs.pop(request.request_id, None)
            self._update_load()
            tracing.record_request(
                self.tracer,
                self.stage_name,
                request.request_id,
                job.traceparent,
                job.timeline,
                job.error,
            )
