"""A streaming stage (a thinker, a talker, code2wav): each request opens a session that
steps on its inputs' chunks as they arrive and hands each step's chunk on at once; the
open sessions waiting to step share engine calls (session_steps.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from omnipipe.api.wire import StageEvent, SubmitRequest
from omnipipe.stagekit.stage import Chunk, Session, StageJob, StepResult, StreamingStage
from omnipipe.transfer import Message
from omnipipe.worker import tracing
from omnipipe.worker.jobs import Job
from omnipipe.worker.scheduling.base import Host, Scheduler
from omnipipe.worker.scheduling.session_steps import SessionStepper


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


class StreamingScheduler(Scheduler):
    def __init__(self, stage: StreamingStage, host: Host) -> None:
        super().__init__(host)
        self.stage = stage
        self._stepper = SessionStepper(stage, host.engine.run, host.max_batch)

    async def run(self) -> None:
        """Nothing to run: each request's coroutine steps its own session (serve)."""

    async def _feed(self, request: SubmitRequest, inbox: Inbox) -> None:
        async for message in self.host.inputs.messages(request):
            inbox.chunks.append(Chunk(message.source, message.tensors, message.final))
            inbox.arrived.set()

    def _account(self, job: Job, clock: AudioClock, step: StepResult, seconds: float) -> None:
        clock.engine_seconds += seconds
        if step.audio_seconds > 0:
            if clock.first is None:
                clock.first = time.monotonic()
                self.host.metrics.observe_first_audio(clock.first - job.submitted)
            clock.audio_seconds += step.audio_seconds
        if step.done and clock.audio_seconds > 0:
            self.host.metrics.observe_real_time_factor(clock.engine_seconds / clock.audio_seconds)

    async def serve(self, job: Job) -> list[dict[str, Any]]:
        """Open a session, then alternate: step it on the engine thread (the executor's
        FIFO interleaves all open sessions), hand its chunk on, wait for input if starved."""
        stage = self.stage
        request = job.request
        job.stage_job = StageJob(request.params, {})
        job.queued = time.monotonic()
        job.timeline.mark(tracing.QUEUED)
        await self.host.engine.prepare(stage.prepare, job.stage_job)
        session: Session = await self.host.engine.run(stage.open, job.stage_job)
        self._start([job])
        inbox = Inbox()
        feeder = asyncio.create_task(self._feed(request, inbox))
        clock = AudioClock()
        chunk_index = event_index = 0
        try:
            while True:
                started = time.monotonic()
                step = await self._stepper.step(session, inbox.take())
                if step is None:
                    if inbox.chunks:
                        continue
                    if feeder.done():
                        feeder.result()  # re-raises a failed feed
                        raise RuntimeError(
                            f"{self.host.stage_name} wants input after its inputs ended"
                        )
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
                    await self.host.handoffs.send_all(
                        [
                            (
                                dest.address,
                                Message(
                                    request.request_id,
                                    self.host.stage_name,
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
                        self.host.metrics.observe_engine(engine_seconds)
                    return []
        finally:
            feeder.cancel()
            # Runs after any step still on the engine thread, never beside it.
            self.host.engine.run_later(session.close)
