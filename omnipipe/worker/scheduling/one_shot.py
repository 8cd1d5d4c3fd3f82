"""A one-shot stage (an encoder, a VAE decoder): each batch from the queue runs whole in
one engine call, run_batch."""

from __future__ import annotations

from omnipipe.stagekit.stage import Stage
from omnipipe.worker.scheduling.queued import QueuedScheduler


class OneShotScheduler(QueuedScheduler[Stage]):
    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = await self._next_batch()
                if not batch:
                    continue
                stage_jobs = [j.stage_job for j in batch if j.stage_job is not None]
                try:
                    results = await self.host.engine.run(self.stage.run_batch, stage_jobs)
                except Exception as exc:
                    for job in batch:
                        self._settle(job, None, exc)
                else:
                    for job, result in zip(batch, results, strict=True):
                        self._settle(job, result, None)
                self.host.load_changed()
