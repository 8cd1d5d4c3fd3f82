"""The queue where a one-shot or stepped stage's requests wait for the engine, once their
inputs are in, and the batches made up from it: the queue's head and what may run with
it (the same batch_key), held a little while requests on their way may still join."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Generic, TypeVar

from omnipipe.stagekit.stage import Stage, StageJob, StageResult
from omnipipe.transfer import Message
from omnipipe.worker import tracing
from omnipipe.worker.jobs import Job
from omnipipe.worker.scheduling.base import Host, Scheduler

StageT = TypeVar("StageT", bound=Stage)


class QueuedScheduler(Scheduler, Generic[StageT]):
    def __init__(self, stage: StageT, host: Host) -> None:
        super().__init__(host)
        self.stage = stage
        self._queue: deque[Job] = deque()
        self._wakeup = asyncio.Event()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def serve(self, job: Job) -> list[dict[str, Any]]:
        request = job.request
        job.stage_job = StageJob(request.params, {})
        await self.host.inputs.collect(request, job.stage_job, job.timeline)
        if request.inputs:
            job.timeline.mark(tracing.INPUTS)
        job.result = asyncio.get_running_loop().create_future()
        job.queued = time.monotonic()
        job.timeline.mark(tracing.QUEUED)
        self._queue.append(job)
        self._wakeup.set()
        try:
            result = await job.result
        finally:
            if job in self._queue:
                self._queue.remove(job)
        await self.host.handoffs.send_all(
            [
                (dest.address, Message(request.request_id, self.host.stage_name, result.tensors))
                for dest in request.outputs
            ]
        )
        job.timeline.mark(tracing.HANDED_OFF)
        job.usage = result.usage
        return result.outputs

    def _take_batch(self) -> list[Job]:
        first = self._queue.popleft()
        batch = [first]
        self._take_compatible(batch)
        return batch

    def _take_compatible(self, batch: list[Job], limit: int | None = None) -> None:
        """Moves queued jobs that may run with batch[0] into the batch, until it holds
        `limit` (max_batch by default)."""
        limit = self.host.max_batch if limit is None else limit
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
        return sum(1 for j in self.host.jobs.values() if j.result is None and not j.running)

    async def _admit(self, batch: list[Job]) -> None:
        """Holds a batch that is not full, at most batch_wait_seconds, while requests
        already sent here are still receiving their inputs: each that arrives compatible
        joins. With none on its way it returns at once, so a lone request never waits."""
        assert batch[0].stage_job is not None
        if self.stage.batch_key(batch[0].stage_job) is None:
            return
        deadline = time.monotonic() + self.host.batch_wait_seconds
        while len(batch) < self.host.max_batch and self._on_their_way():
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
        return self.host.jobs.get(job.request.request_id) is job and not (
            job.stage_job is not None and job.stage_job.cancelled.is_set()
        )

    async def _next_batch(self) -> list[Job]:
        """The head of the queue and what may run with it, marked running."""
        batch = self._take_batch()
        if self.host.batch_wait_seconds > 0:
            await self._admit(batch)
            # Requests cancelled while the batch waited have left it.
            batch = [j for j in batch if self._live(j)]
        self._start(batch)
        return batch

    def _settle(self, job: Job, result: StageResult | None, error: BaseException | None) -> None:
        job.running = False
        job.timeline.mark(tracing.ENGINE_DONE)
        engine_seconds = job.timeline.seconds(tracing.STARTED, tracing.ENGINE_DONE)
        if engine_seconds is not None:
            self.host.metrics.observe_engine(engine_seconds)
        if job.result and not job.result.done():
            if error is not None:
                job.result.set_exception(error)
            else:
                job.result.set_result(result or StageResult())
