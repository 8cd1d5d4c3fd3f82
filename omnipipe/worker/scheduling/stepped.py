"""A stepped stage (a diffusion denoiser): the requests of a batch share each engine
step, and requests join or leave between steps."""

from __future__ import annotations

from typing import Any

from omnipipe.api.wire import StageEvent
from omnipipe.stagekit.stage import SteppedStage
from omnipipe.worker.jobs import Job
from omnipipe.worker.scheduling.queued import QueuedScheduler


class SteppedScheduler(QueuedScheduler[SteppedStage]):
    async def run(self) -> None:
        """Requests share each step: compatible ones join between steps (the queue's
        head decides; one that cannot join waits for the batch to drain), and one whose
        request is gone leaves at the next step while the rest go on."""
        stage = self.stage
        active: list[tuple[Job, Any]] = []
        while True:
            if not active and not self._queue:
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            joining: list[Job] = []
            if not active:
                joining = await self._next_batch()
            elif self._queue and len(active) < self.host.max_batch and stage.joins_between_steps:
                head = self._queue[0]
                assert head.stage_job is not None
                assert active[0][0].stage_job is not None
                key = stage.batch_key(active[0][0].stage_job)
                if key is not None and stage.batch_key(head.stage_job) == key:
                    joining = [self._queue.popleft()]
                    self._take_compatible(joining, self.host.max_batch - len(active))
                    self._start(joining)
            for job in joining:
                assert job.stage_job is not None
                try:
                    active.append((job, await self.host.engine.run(stage.begin, job.stage_job)))
                except Exception as exc:
                    self._settle(job, None, exc)
            for job, _ in active:
                if not self._live(job):
                    job.running = False
            active = [(job, state) for job, state in active if self._live(job)]
            if not active:
                self.host.load_changed()
                continue
            try:
                await self.host.engine.run(stage.step, [state for _, state in active])
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
            self.host.load_changed()
