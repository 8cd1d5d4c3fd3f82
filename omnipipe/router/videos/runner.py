"""Runs video jobs: each router replica takes jobs from the shared queue, runs them
through the stages, and keeps their state in the store. A replica that dies mid-job
stops renewing its lease; another replica's sweep finds the job unfinished and unleased
and queues it again (up to MAX_RUNS runs in all), so a job completes, or fails saying
why, whichever replicas live."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from omnipipe.router.errors import OpenAIError, Overloaded, StageUnavailable
from omnipipe.router.metrics import RouterMetrics
from omnipipe.router.orchestrator import Orchestrator
from omnipipe.router.videos.store import StoreUnavailable, VideoStore

log = logging.getLogger(__name__)
UNFINISHED = ("queued", "in_progress")
# A job whose runners went away this many times fails.
MAX_RUNS = 3
RUNS_FIELD = "_runs"
TAKE_EVERY_SECONDS = 0.25
# A job no stage replica can take is queued again after this pause, for this long at most.
REQUEUE_PAUSE_SECONDS = 5.0
MAX_WAIT_SECONDS = 3600.0
STORE_WARNING_SECONDS = 60.0


def public(job: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI video object, without the runner's own fields."""
    return {k: v for k, v in job.items() if not k.startswith("_")}


class VideoRunner:
    def __init__(
        self,
        store: VideoStore,
        orchestrator: Orchestrator,
        metrics: RouterMetrics,
        *,
        ttl_seconds: int,
        concurrency: int,
        lease_seconds: float = 10.0,
    ) -> None:
        self.store = store
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.ttl_seconds = ttl_seconds
        self.concurrency = concurrency
        self.lease_ms = int(lease_seconds * 1000)
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tasks: list[asyncio.Task[None]] = []
        # Jobs this replica runs now: id -> the task running it.
        self._running: dict[str, asyncio.Task[None]] = {}
        self._warned_at = -STORE_WARNING_SECONDS

    async def start(self) -> None:
        """Starts taking jobs; a store that does not answer yet is retried (the API
        answers 503 meanwhile), so a router that starts before its Redis serves once it
        is up."""
        try:
            await self.store.ping()
        except StoreUnavailable:
            self._store_down("starting")
        self._tasks = [asyncio.create_task(self._take_jobs()) for _ in range(self.concurrency)]
        self._tasks.append(asyncio.create_task(self._sweep_forever()))

    async def close(self) -> None:
        """Stops taking jobs; those running here go back to the queue for another
        replica (a rollout retires this one), not to failure."""
        for task in self._tasks:
            task.cancel()
        running = list(self._running.items())
        for _, task in running:
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for _, t in running), return_exceptions=True)
        for video_id, _ in running:
            with contextlib.suppress(Exception):
                await self._requeue(video_id)
        await self.store.close()

    async def _requeue(self, video_id: str) -> None:
        job = await self.store.get(video_id)
        if job is not None and job["status"] in UNFINISHED:
            job.update(status="queued", progress=0)
            await self.store.put(job)
            await self.store.requeue(video_id)
        await self.store.release(video_id, self.owner)

    def _store_down(self, what: str) -> None:
        """One warning a minute while the store does not answer, not one a poll."""
        now = time.monotonic()
        if now - self._warned_at > STORE_WARNING_SECONDS:
            self._warned_at = now
            log.warning("video job store unavailable (%s); retrying", what)

    async def _take_jobs(self) -> None:
        while True:
            try:
                video_id = await self.store.take(self.owner, self.lease_ms)
            except StoreUnavailable:
                self._store_down("taking a job")
                await asyncio.sleep(1.0)
                continue
            if video_id is None:
                await asyncio.sleep(TAKE_EVERY_SECONDS)
                continue
            task = asyncio.create_task(self._run(video_id))
            self._running[video_id] = task
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.done():
                    raise
            except StoreUnavailable:
                # Its lease runs out unrenewed: a sweep queues it again once the store is back.
                self._store_down(f"running job {video_id}")
            except Exception:
                log.exception("video job %s failed in the router", video_id)
            finally:
                self._running.pop(video_id, None)

    async def _run(self, video_id: str) -> None:
        job, params = await self.store.get(video_id), await self.store.params(video_id)
        if job is None or params is None or job["status"] not in UNFINISHED:
            await self.store.release(video_id, self.owner)
            if job is None:
                await self.store.delete(video_id)  # its client deleted it: the flag goes
            return  # deleted, expired or finished meanwhile
        job.update(status="in_progress", progress=0)
        job[RUNS_FIELD] = job.get(RUNS_FIELD, 0) + 1
        await self.store.put(job)
        steps = {"done": 0, "all": 0}

        def on_progress(_stage: str, step: int, of: int) -> None:
            steps["done"], steps["all"] = step, of

        work = asyncio.create_task(self._generate(params, on_progress))
        keeper = asyncio.create_task(self._keep(video_id, job, steps, work))
        try:
            result = await work
        except asyncio.CancelledError:
            if await self.store.cancelled(video_id):
                log.info("video job %s cancelled by its client", video_id)
                await self.store.delete(video_id)
                return
            raise
        except (StageUnavailable, Overloaded) as exc:
            if time.time() - job["created_at"] < MAX_WAIT_SECONDS:
                # No stage replica could take it (one waking from zero, all full, one
                # gone mid-run): it waits in the queue again, as a job does for a GPU.
                log.info("video job %s waits again: %s", video_id, exc.message)
                job.update(status="queued", progress=0)
                job[RUNS_FIELD] -= 1
                await self.store.put(job)
                await asyncio.sleep(REQUEUE_PAUSE_SECONDS)
                await self.store.requeue(video_id)
                return
            self._fail(job, f"no stage could run it for {MAX_WAIT_SECONDS:.0f}s: {exc.message}")
            await self.store.put(job, self.ttl_seconds)
            return
        except OpenAIError as exc:
            job.update(status="failed", error={"code": exc.type, "message": exc.message})
            await self.store.put(job, self.ttl_seconds)
            log.warning("video job %s failed: %s", video_id, exc.message)
            return
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.store.release(video_id, self.owner)
        now = int(time.time())
        job.update(
            status="completed",
            progress=100,
            completed_at=now,
            expires_at=now + self.ttl_seconds,
        )
        if not await self.store.finish(job, base64.b64decode(result["b64_mp4"]), self.ttl_seconds):
            log.info("video job %s was deleted as it finished", video_id)
            await self.store.delete(video_id)

    @staticmethod
    def _fail(job: dict[str, Any], message: str) -> None:
        job.update(status="failed", error={"code": "service_unavailable", "message": message})
        log.warning("video job %s failed: %s", job["id"], message)

    async def _generate(
        self, params: dict[str, Any], on_progress: Callable[[str, int, int], None]
    ) -> dict[str, Any]:
        orch = self.orchestrator
        outputs = set(orch.outputs)
        stream = orch.stream({stage: params for stage in orch.stages}, outputs, on_progress)
        async with contextlib.aclosing(stream) as items:
            async for item in items:
                return dict(item.data)
        raise OpenAIError("the pipeline finished without a video")

    async def _keep(
        self, video_id: str, job: dict[str, Any], steps: dict[str, int], work: asyncio.Task[Any]
    ) -> None:
        """While the job runs: renew its lease, write its progress, and stop it when its
        client deletes it or another replica has taken it over."""
        written = 0
        while not work.done():
            await asyncio.sleep(1.0)
            try:
                held = await self.store.renew(video_id, self.owner, self.lease_ms)
                if not held or await self.store.cancelled(video_id):
                    work.cancel()
                    return
                # The denoiser's steps are the job's progress; decoding is the last 1%.
                percent = min(99, 100 * steps["done"] // steps["all"]) if steps["all"] else 0
                if percent != written:
                    job["progress"] = written = percent
                    await self.store.put(job)
            except StoreUnavailable:
                self._store_down(f"renewing job {video_id}")
            except Exception:
                log.exception("keeping video job %s failed", video_id)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 2000)
            try:
                await self.sweep()
            except StoreUnavailable:
                self._store_down("sweeping")
            except Exception:
                log.exception("sweeping video jobs failed")

    async def sweep(self) -> None:
        """Queues again each unfinished job that no replica holds, forgets expired ones,
        and publishes how many jobs wait and for how long."""
        queued = set(await self.store.queued())
        gone, now = [], time.time()
        counts = {s: 0 for s in UNFINISHED}
        oldest = {s: 0.0 for s in UNFINISHED}
        for video_id in await self.store.ids(newest_first=False):
            job = await self.store.get(video_id)
            if job is None:
                gone.append(video_id)
                continue
            if job["status"] not in UNFINISHED:
                continue
            status = str(job["status"])
            counts[status] += 1
            oldest[status] = max(oldest[status], now - job["created_at"])
            if video_id in queued or video_id in self._running:
                continue
            if await self.store.claim(video_id, self.owner, self.lease_ms):
                await self._recover(video_id, job)
        await self.store.forget(gone)
        name = self.orchestrator.pipeline.name
        for status in UNFINISHED:
            self.metrics.video_jobs.labels(name, status).set(counts[status])
            self.metrics.video_job_age.labels(name, status).set(oldest[status])

    async def _recover(self, video_id: str, job: dict[str, Any]) -> None:
        runs = int(job.get(RUNS_FIELD, 0))
        if runs >= MAX_RUNS:
            job.update(
                status="failed",
                error={
                    "code": "runner_lost",
                    "message": f"the router replica running this job went away {runs} times",
                },
            )
            await self.store.put(job, self.ttl_seconds)
            log.warning("video job %s failed: its runners went away %d times", video_id, runs)
        else:
            log.info("video job %s lost its runner; queued again", video_id)
            job.update(status="queued", progress=0)
            await self.store.put(job)
            await self.store.requeue(video_id)
        await self.store.release(video_id, self.owner)
