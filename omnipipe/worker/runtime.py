"""Request lifecycle inside one worker: wait for inputs, batch, run, hand on, report.

Everything here runs on the event loop except the engine call, which runs on one
dedicated thread so the loop keeps serving transfers and health checks meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry import trace

from omnipipe.api.wire import StageEvent, SubmitRequest
from omnipipe.transfer import Mailbox, Message, Sender, TransferRefused
from omnipipe.transfer.handoffs import HandOffs
from omnipipe.worker import tracing
from omnipipe.worker.metrics import WorkerMetrics
from omnipipe.worker.session_steps import SessionStepper
from omnipipe.worker.stages.base import (
    Chunk,
    Session,
    Stage,
    StageInputError,
    StageJob,
    StageResult,
    SteppedStage,
    StepResult,
    StreamingStage,
    Tensors,
)
from omnipipe.worker.threads import set_thread_team

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


@dataclass
class Inbox:
    """Chunks that arrived for a streaming request and were not yet handed to it."""

    chunks: list[Chunk] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self) -> list[Chunk]:
        chunks, self.chunks = self.chunks, []
        self.arrived.clear()
        return chunks


@dataclass
class AudioClock:
    """Per request: when audio first appeared, how much, and the engine time it took."""

    first: float | None = None
    audio_seconds: float = 0.0
    engine_seconds: float = 0.0


@dataclass
class Job:
    request: SubmitRequest
    events: asyncio.Queue[StageEvent] = field(default_factory=asyncio.Queue)
    result: asyncio.Future[StageResult] | None = None
    stage_job: StageJob | None = None
    task: asyncio.Task[None] | None = None
    submitted: float = field(default_factory=time.monotonic)
    queued: float = 0.0
    running: bool = False
    timeline: tracing.Timeline = field(default_factory=tracing.Timeline)
    error: str = ""
    traceparent: str = ""  # the router's span, this stage's spans' parent
    admitted: bool = False  # past the pause gate: its work may start
    aborted: str = ""  # why the worker aborted it (a pause), if it did

    def __post_init__(self) -> None:
        self.timeline.mark(tracing.SUBMITTED)


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
        self.stage = stage
        self.mailbox = mailbox
        self.sender = sender
        # Every request's chunks for one destination in one transport message per turn
        # of the loop: a step of 16 sessions sends one batch per talker replica (#25).
        self.handoffs = HandOffs(sender)
        self.metrics = metrics
        self.max_batch = max_batch
        self.batch_wait_seconds = batch_wait_seconds
        self.jobs: dict[str, Job] = {}
        self._queue: deque[Job] = deque()
        self._wakeup = asyncio.Event()
        # A colocated stage's threads take its share of the process's cores (threads);
        # alone in its process, the process-wide budget already fits it.
        team = (set_thread_team, (threads,)) if threads is not None else (None, ())
        self._engine = ThreadPoolExecutor(1, "engine", *team)
        # Requests' preparation (decoding media) beside the engine, one at a time: the
        # processors' tokenizers are not safe to share between threads.
        self._preparer = ThreadPoolExecutor(1, "prepare", *team)
        self._loop_task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        # The watchdog's view of the engine thread: when the call now running last made
        # progress (None: the thread is idle). Written on that thread, read on the loop.
        self._progress_at: float | None = None
        # Per request: what gives its received KV rows back to the receiver's BlockTable.
        self._row_releases: dict[str, list[Callable[[], None]]] = {}
        self._stepper: SessionStepper | None = None
        # Cleared while generation is paused: requests that arrive wait, those admitted
        # before go on (worker/control.py).
        self.admitting = asyncio.Event()
        self.admitting.set()
        self._none_admitted = asyncio.Event()
        self._none_admitted.set()
        # Called before a request's work starts: wakes a sleeping stage (control.py).
        self.before_work: Callable[[], Awaitable[None]] | None = None

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

    # ---- watchdog ----------------------------------------------------------------------
    def progress(self) -> None:
        """Called from the engine thread between units of work (a denoising step)."""
        self._progress_at = time.monotonic()

    def _on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs on the engine thread: fn, with the watchdog's clock running while it does."""
        self._progress_at = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._progress_at = None

    async def beside_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn on the preparation thread, the one other thread that uses the stage's
        processors (their tokenizers are not safe to share between threads)."""
        return await asyncio.get_running_loop().run_in_executor(self._preparer, fn, *args)

    async def between_batches(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn on the engine thread, where no batch runs beside it (a LoRA change)."""
        return await self._run_on_engine(fn, *args)

    async def _run_on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._engine, self._on_engine, fn, *args)

    def seconds_without_progress(self) -> float:
        """How long the engine call now running has gone without progress; 0 when idle."""
        since = self._progress_at
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self.stage is not None:
            self.stage.progress = self.progress
            self.stage.count_steps = self.metrics.count_steps
        self._stepper = None
        self._loop_task = asyncio.create_task(self._engine_loop(), name="engine-loop")

    async def stop_engine_loop(self) -> None:
        """Ends the engine loop (nothing may be running: pause first), so start() can run
        it on another stage object (a stage woken from sleep)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self._stepper = None

    async def close(self) -> None:
        for job in list(self.jobs.values()):
            if job.task:
                job.task.cancel()
        if self._loop_task:
            self._loop_task.cancel()
        await self.handoffs.close()
        self._engine.shutdown(wait=False, cancel_futures=True)
        self._preparer.shutdown(wait=False, cancel_futures=True)

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
    async def _messages(self, request: SubmitRequest) -> AsyncIterator[Message]:
        """The request's chunks from its upstream stages, until each has sent its last."""
        pending = set(request.inputs)
        while pending:
            message = await self.mailbox.get(request.request_id)
            if message.source not in pending:
                log.warning(
                    "request %s: unexpected input from %s", request.request_id, message.source
                )
                continue
            yield message
            if message.final:
                pending.discard(message.source)

    async def _collect_inputs(
        self, request: SubmitRequest, job: StageJob, timeline: tracing.Timeline
    ) -> None:
        """Fills the job's inputs, and its KV blocks (rows of the receiver's BlockTable,
        which job.free_rows gives back)."""
        inputs: dict[str, Tensors] = {name: {} for name in request.inputs}
        try:
            async for message in self._messages(request):
                if message.received_ns is not None:
                    timeline.mark_first(tracing.FIRST_INPUT, message.received_ns[0])
                inputs[message.source].update(message.tensors)
                if message.blocks:
                    job.blocks.setdefault(message.source, []).extend(message.blocks)
                    if message.on_drop is not None:
                        self._row_releases.setdefault(request.request_id, []).append(
                            message.on_drop
                        )
        finally:
            job.inputs = inputs

    def _free_rows(self, request_id: str) -> None:
        """After whatever the engine thread is running now (it may still read the rows):
        the engine's FIFO runs this after it, and the table is touched on the loop."""
        releases = self._row_releases.pop(request_id, [])
        if not releases:
            return
        loop = asyncio.get_running_loop()

        def release_on_loop() -> None:
            for release in releases:
                loop.call_soon_threadsafe(release)

        self._engine.submit(release_on_loop)

    async def _feed(self, request: SubmitRequest, inbox: Inbox) -> None:
        async for message in self._messages(request):
            inbox.chunks.append(Chunk(message.source, message.tensors, message.final))
            inbox.arrived.set()

    def _account(self, job: Job, clock: AudioClock, step: StepResult, seconds: float) -> None:
        clock.engine_seconds += seconds
        if step.audio_seconds > 0:
            if clock.first is None:
                clock.first = time.monotonic()
                self.metrics.observe_first_audio(clock.first - job.submitted)
            clock.audio_seconds += step.audio_seconds
        if step.done and clock.audio_seconds > 0:
            self.metrics.observe_real_time_factor(clock.engine_seconds / clock.audio_seconds)

    async def _stream(self, job: Job, stage: StreamingStage) -> None:
        """Open a session, then alternate: step it on the engine thread (the executor's
        FIFO interleaves all open sessions), hand its chunk on, wait for input if starved."""
        request = job.request
        job.stage_job = StageJob(request.params, {})
        job.queued = time.monotonic()
        job.timeline.mark(tracing.QUEUED)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._preparer, stage.prepare, job.stage_job)
        session: Session = await self._run_on_engine(stage.open, job.stage_job)
        stepper = self._session_stepper(stage)
        self._start([job])
        inbox = Inbox()
        feeder = asyncio.create_task(self._feed(request, inbox))
        clock = AudioClock()
        chunk_index = event_index = 0
        try:
            while True:
                started = time.monotonic()
                step = await stepper.step(session, inbox.take())
                if step is None:
                    if inbox.chunks:
                        continue
                    if feeder.done():
                        feeder.result()  # re-raises a failed feed
                        raise RuntimeError(f"{self.stage_name} wants input after its inputs ended")
                    arrived = asyncio.ensure_future(inbox.arrived.wait())
                    try:
                        await asyncio.wait({feeder, arrived}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        arrived.cancel()
                    continue
                self._account(job, clock, step, time.monotonic() - started)
                if step.tensors or step.done:
                    # No await before this: every session of the step queues its chunks
                    # in the same turn, and they leave in one batch per destination.
                    await self.handoffs.send_all(
                        [
                            (
                                dest.address,
                                Message(
                                    request.request_id,
                                    self.stage_name,
                                    step.tensors,
                                    chunk=chunk_index,
                                    final=step.done,
                                    blocks=step.blocks,
                                ),
                            )
                            for dest in request.outputs
                        ]
                    )
                    chunk_index += 1
                if request.emit:
                    for output in step.outputs:
                        await job.events.put(
                            StageEvent(type="result", index=event_index, data=output)
                        )
                        event_index += 1
                if step.done:
                    # Its hand-offs ran between its steps, inside the engine phase.
                    finished = time.time_ns()
                    job.timeline.mark(tracing.ENGINE_DONE, finished)
                    job.timeline.mark(tracing.HANDED_OFF, finished)
                    job.timeline.attributes["omnipipe.engine_busy_seconds"] = clock.engine_seconds
                    job.timeline.attributes["omnipipe.chunks"] = chunk_index
                    engine_seconds = job.timeline.seconds(tracing.STARTED, tracing.ENGINE_DONE)
                    if engine_seconds is not None:
                        self.metrics.observe_engine(engine_seconds)
                    return
        finally:
            feeder.cancel()
            # Runs after any step still on the engine thread, never beside it.
            self._engine.submit(session.close)

    def _session_stepper(self, stage: StreamingStage) -> SessionStepper:
        if self._stepper is None:
            self._stepper = SessionStepper(stage, self._run_on_engine, self.max_batch)
        return self._stepper

    async def _drive(self, job: Job) -> None:
        request = job.request
        try:
            async with asyncio.timeout(request.timeout_seconds):
                while True:
                    await self.admitting.wait()
                    if self.before_work is not None:
                        await self.before_work()
                    if self.admitting.is_set():  # not paused again meanwhile
                        break
                job.admitted = True
                self._update_load()
                if isinstance(self.stage, StreamingStage):
                    await self._stream(job, self.stage)
                    job.timeline.mark(tracing.DONE)
                    await job.events.put(StageEvent(type="done"))
                    self.metrics.observe_duration(time.monotonic() - job.submitted)
                    return
                job.stage_job = StageJob(request.params, {})
                await self._collect_inputs(request, job.stage_job, job.timeline)
                if request.inputs:
                    job.timeline.mark(tracing.INPUTS)
                job.result = asyncio.get_running_loop().create_future()
                job.queued = time.monotonic()
                job.timeline.mark(tracing.QUEUED)
                self._queue.append(job)
                self._wakeup.set()
                result = await job.result
                await self.handoffs.send_all(
                    [
                        (dest.address, Message(request.request_id, self.stage_name, result.tensors))
                        for dest in request.outputs
                    ]
                )
                job.timeline.mark(tracing.HANDED_OFF)
            if request.emit:
                for i, output in enumerate(result.outputs):
                    await job.events.put(StageEvent(type="result", index=i, data=output))
            job.timeline.mark(tracing.DONE)
            await job.events.put(StageEvent(type="done"))
            self.metrics.observe_duration(time.monotonic() - job.submitted)
        except asyncio.CancelledError:
            job.error = "aborted" if job.aborted else "cancelled"
            if job.stage_job is not None:
                job.stage_job.cancelled.set()
            await job.events.put(self._cancel_event(job))
        except TimeoutError:
            job.error = "timeout"
            # Stop the engine's work too: a denoising loop checks this between steps (a
            # streaming session is closed by _stream's finally).
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
            if job in self._queue:
                self._queue.remove(job)
            self._free_rows(request.request_id)
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

    # ---- engine ------------------------------------------------------------------------
    def _take_batch(self) -> list[Job]:
        first = self._queue.popleft()
        batch = [first]
        self._take_compatible(batch)
        return batch

    def _take_compatible(self, batch: list[Job], limit: int | None = None) -> None:
        """Moves queued jobs that may run with batch[0] into the batch, until it holds
        `limit` (max_batch by default)."""
        limit = self.max_batch if limit is None else limit
        assert self.stage is not None
        assert batch[0].stage_job is not None
        key = self.stage.batch_key(batch[0].stage_job)
        if key is None:
            return
        for job in list(self._queue):
            if len(batch) >= limit:
                break
            if job.stage_job is not None and self.stage.batch_key(job.stage_job) == key:
                self._queue.remove(job)
                batch.append(job)

    def _on_their_way(self) -> int:
        """Jobs submitted here whose inputs are still upstream."""
        return sum(1 for j in self.jobs.values() if j.result is None and not j.running)

    async def _admit(self, batch: list[Job]) -> None:
        """Holds a batch that is not full, at most batch_wait_seconds, while requests
        already sent here are still receiving their inputs: each that arrives compatible
        joins. With none on its way it returns at once, so a lone request never waits."""
        assert self.stage is not None
        assert batch[0].stage_job is not None
        if self.stage.batch_key(batch[0].stage_job) is None:
            return
        deadline = time.monotonic() + self.batch_wait_seconds
        while len(batch) < self.max_batch and self._on_their_way():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except TimeoutError:
                return
            self._take_compatible(batch)

    def _live(self, job: Job) -> bool:
        """Still wanted: not cancelled, timed out or gone."""
        return self.jobs.get(job.request.request_id) is job and not (
            job.stage_job is not None and job.stage_job.cancelled.is_set()
        )

    async def _next_batch(self) -> list[Job]:
        """The head of the queue and what may run with it, marked running."""
        batch = self._take_batch()
        if self.batch_wait_seconds > 0:
            await self._admit(batch)
            # Requests cancelled while the batch waited have left it.
            batch = [j for j in batch if self._live(j)]
        self._start(batch)
        return batch

    def _start(self, jobs: list[Job]) -> None:
        """Mark jobs running, with the time they waited in the queue."""
        for job in jobs:
            job.running = True
            job.timeline.mark(tracing.STARTED)
            self.metrics.observe_queue_wait(time.monotonic() - job.queued)
        self._update_load()

    def _settle(self, job: Job, result: StageResult | None, error: BaseException | None) -> None:
        job.running = False
        job.timeline.mark(tracing.ENGINE_DONE)
        engine_seconds = job.timeline.seconds(tracing.STARTED, tracing.ENGINE_DONE)
        if engine_seconds is not None:
            self.metrics.observe_engine(engine_seconds)
        if job.result and not job.result.done():
            if error is not None:
                job.result.set_exception(error)
            else:
                job.result.set_result(result or StageResult())

    async def _stepped_loop(self, stage: SteppedStage) -> None:
        """Requests share each step: compatible ones join between steps (the queue's
        head decides; one that cannot join waits for the batch to drain), and one whose
        request is gone leaves at the next step while the rest go on."""
        active: list[tuple[Job, Any]] = []
        while True:
            if not active and not self._queue:
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            joining: list[Job] = []
            if not active:
                joining = await self._next_batch()
            elif self._queue and len(active) < self.max_batch and stage.joins_between_steps:
                head = self._queue[0]
                assert head.stage_job is not None
                assert active[0][0].stage_job is not None
                key = stage.batch_key(active[0][0].stage_job)
                if key is not None and stage.batch_key(head.stage_job) == key:
                    joining = [self._queue.popleft()]
                    self._take_compatible(joining, self.max_batch - len(active))
                    self._start(joining)
            for job in joining:
                assert job.stage_job is not None
                try:
                    active.append((job, await self._run_on_engine(stage.begin, job.stage_job)))
                except Exception as exc:
                    self._settle(job, None, exc)
            for job, _ in active:
                if not self._live(job):
                    job.running = False
            active = [(job, state) for job, state in active if self._live(job)]
            if not active:
                self._update_load()
                continue
            try:
                await self._run_on_engine(stage.step, [state for _, state in active])
            except Exception as exc:
                for job, _ in active:
                    self._settle(job, None, exc)
                active = []
            for job, state in active:
                if job.request.progress and (count := stage.step_count(state)) is not None:
                    job.events.put_nowait(
                        StageEvent(type="progress", data={"step": count[0], "steps": count[1]})
                    )
                if stage.finished(state):
                    self._settle(job, stage.finish(state), None)
            active = [(job, state) for job, state in active if job.running]
            self._update_load()

    async def _engine_loop(self) -> None:
        if isinstance(self.stage, SteppedStage):
            await self._stepped_loop(self.stage)
            return
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue and self.stage is not None:
                batch = await self._next_batch()
                if not batch:
                    continue
                stage_jobs = [j.stage_job for j in batch if j.stage_job is not None]
                try:
                    results = await self._run_on_engine(self.stage.run_batch, stage_jobs)
                except Exception as exc:
                    for job in batch:
                        self._settle(job, None, exc)
                else:
                    for job, result in zip(batch, results, strict=True):
                        self._settle(job, result, None)
                self._update_load()
