"""A one-shot stage (an encoder, a VAE decoder): each batch from the queue runs whole in
one engine call, run_batch."""

from __future__ import annotations

import asyncio

from omnipipe.api.wire import StageEvent
from omnipipe.stagekit.stage import Stage, StageInputError
from omnipipe.worker.jobs import Job
from omnipipe.worker.scheduling.queued import QueuedScheduler


def report_steps(job: Job, loop: asyncio.AbstractEventLoop) -> None:
    """Where the request asked for progress: each step the stage reports (on the engine
    thread) becomes a progress event on the request's stream (on the loop)."""
    if not job.request.progress or job.stage_job is None:
        return

    def on_step(step: int, steps: int) -> None:
        event = StageEvent(type="progress", data={"step": step, "steps": steps})
        loop.call_soon_threadsafe(job.events.put_nowait, event)

    job.stage_job.on_step = on_step


class OneShotScheduler(QueuedScheduler[Stage]):
    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = await self._next_batch()
                if not batch:
                    continue
                loop = asyncio.get_running_loop()
                for job in batch:
                    report_steps(job, loop)
                await self._run(batch)
                self.host.load_changed()

    async def _run(self, batch: list[Job]) -> None:
        stage_jobs = [j.stage_job for j in batch if j.stage_job is not None]
        try:
            results = await self.host.engine.run(self.stage.run_batch, stage_jobs)
        except StageInputError as exc:
            if len(batch) == 1:
                self._settle(batch[0], None, exc)
                return
            # One request's input refused fails the call it shares: each runs again
            # alone, so that the refusal reaches the request it is about and the others
            # are answered, not failed with another client's 400.
            for job in batch:
                await self._run([job])
        except Exception as exc:
            for job in batch:
                self._settle(job, None, exc)
        else:
            for job, result in zip(batch, results, strict=True):
                self._settle(job, result, None)
