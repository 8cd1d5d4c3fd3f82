"""Runs video jobs: each router replica takes jobs from the shared queue, runs them
through the stages, and keeps their state in the store. A replica that dies mid-job
stops renewing its lease; another replica's sweep finds the job unfinished, unqueued and
unleased and queues it again (up to MAX_RUNS runs in all), so a job completes, or fails
saying why, whichever replicas live."""

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
from omnipipe.router.redis_store import StoreUnavailable
from omnipipe.router.videos.store import VideoStore

log = logging.getLogger(__name__)
UNFINISHED = ("queued", "in_progress")
# A job whose runners went away this many times fails.
MAX_RUNS = 3
RUNS_FIELD = "_runs"
UNAVAILABLE = "service_unavailable"
TAKE_EVERY_SECONDS = 0.25
STORE_WARNING_SECONDS = 60.0
# A job no stage replica can take is queued again after this pause, for this long at most.
REQUEUE_PAUSE_SECONDS = 5.0
MAX_WAIT_SECONDS = 3600.0


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
        timeout_seconds: float,
        max_bytes: int,
        lease_seconds: float = 10.0,
    ) -> None:
        self.store = store
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.ttl_seconds = ttl_seconds
        self.concurrency = concurrency
        self.timeout_seconds = timeout_seconds
        self.max_bytes = max_bytes
        self.lease_ms = int(lease_seconds * 1000)
        # A lease is renewed three times within its life: one late renewal loses nothing.
        self.renew_every = lease_seconds / 3
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tasks: list[asyncio.Task[None]] = []
        # Jobs this replica runs now: id -> the task running it.
        self._running: dict[str, asyncio.Task[None]] = {}
        self._closing = False
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
        self._closing = True
        for task in self._tasks:
            task.cancel()
        running = list(self._running.items())
        for _, task in running:
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for _, t in running), return_exceptions=True)
        for video_id, _ in running:
            with contextlib.suppress(Exception):
                await self._give_back(video_id)
        await self.store.close()

    async def _give_back(self, video_id: str) -> None:
        """A job this replica stops running, queued again; the run does not count
        against it (nothing went wrong)."""
        job = await self.store.get(video_id)
        if job is not None and job["status"] in UNFINISHED:
            await self._queue_again(job, uncount_run=True)
        await self.store.release(video_id, self.owner)

    def _store_down(self, what: str) -> None:
        """One warning a minute while the store does not answer, not one a poll."""
        now = time.monotonic()
        if now - self._warned_at > STORE_WARNING_SECONDS:
            self._warned_at = now
            log.warning("video job store unavailable (%s); retrying", what)

    async def _take_jobs(self) -> None:
        while not self._closing:
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
                # The job's own cancellation (its client deleted it) is not this loop's.
                current = asyncio.current_task()
                if not task.done() or (current is not None and current.cancelling()):
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
        if job is None:
            await self.store.delete(video_id)  # its client deleted it: the flag goes too
            await self.store.release(video_id, self.owner)
            return
        if job["status"] not in UNFINISHED:
            await self.store.release(video_id, self.owner)
            return
        if params is None:
            await self._fail(job, UNAVAILABLE, "its parameters are gone from the store (evicted?)")
            await self.store.release(video_id, self.owner)
            return
        job.update(status="in_progress", progress=0)
        job[RUNS_FIELD] = job.get(RUNS_FIELD, 0) + 1
        await self.store.put(job)
        steps = {"done": 0, "all": 0}

        def on_progress(_stage: str, step: int, of: int) -> None:
            steps["done"], steps["all"] = step, of

        work = asyncio.create_task(self._generate(params, on_progress))
        keeper = asyncio.create_task(self._keep(video_id, job, steps, work))
        try:
            await self._settle(video_id, job, work)
        finally:
            work.cancel()
            keeper.cancel()
            # The work's own cleanup (cancelling the stages) ends before the lease goes.
            await asyncio.gather(work, keeper, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.store.release(video_id, self.owner)

    async def _settle(self, video_id: str, job: dict[str, Any], work: asyncio.Task[Any]) -> None:
        """Waits for the job's work and writes what came of it, holding the lease."""
        try:
            result = await work
        except asyncio.CancelledError:
            if await self.store.cancelled(video_id):
                log.info("video job %s cancelled by its client", video_id)
                await self.store.delete(video_id)
                return
            raise
        except (StageUnavailable, Overloaded) as exc:
            if time.time() - job["created_at"] >= MAX_WAIT_SECONDS:
                waited = f"no stage could run it for {MAX_WAIT_SECONDS:.0f}s: {exc.message}"
                await self._fail(job, UNAVAILABLE, waited)
                return
            # No stage replica could take it (one waking from zero, all full, one gone
            # mid-run): it waits in the queue again, as a job does for a GPU. The lease,
            # still renewed, keeps the sweep off it meanwhile.
            log.info("video job %s waits again: %s", video_id, exc.message)
            await self._queue_again(job, uncount_run=True, pause=REQUEUE_PAUSE_SECONDS)
            return
        except OpenAIError as exc:
            await self._fail(job, exc.type, exc.message)
            return
        mp4 = base64.b64decode(result["b64_mp4"])
        if len(mp4) > self.max_bytes:
            too_big = (
                f"the video is {len(mp4):,} bytes, past the {self.max_bytes:,} a job may keep "
                "(OMNIPIPE_ROUTER_VIDEO_MAX_BYTES): ask for fewer frames or a smaller size"
            )
            await self._fail(job, "video_too_large", too_big)
            return
        now = int(time.time())
        job.update(
            status="completed", progress=100, completed_at=now, expires_at=now + self.ttl_seconds
        )
        if not await self.store.finish(job, mp4, self.ttl_seconds, self.owner):
            log.info("video job %s was deleted or taken over as it finished", video_id)
            if await self.store.cancelled(video_id):
                await self.store.delete(video_id)

    async def _fail(self, job: dict[str, Any], code: str, message: str) -> None:
        job.update(status="failed", error={"code": code, "message": message})
        await self.store.put(job, self.ttl_seconds)
        log.warning("video job %s failed: %s", job["id"], message)

    async def _queue_again(
        self, job: dict[str, Any], uncount_run: bool = False, pause: float = 0.0
    ) -> None:
        """The job back in the queue (after `pause`, shown queued meanwhile); uncount_run:
        the run that ends here does not count against MAX_RUNS (nothing went wrong)."""
        job.update(status="queued", progress=0)
        if uncount_run:
            job[RUNS_FIELD] = max(0, job.get(RUNS_FIELD, 0) - 1)
        await self.store.put(job)
        await asyncio.sleep(pause)
        await self.store.requeue(job["id"])

    async def _generate(
        self, params: dict[str, Any], on_progress: Callable[[str, int, int], None]
    ) -> dict[str, Any]:
        orch = self.orchestrator
        stream = orch.stream(
            {stage: params for stage in orch.stages},
            set(orch.outputs),
            on_progress,
            limit_seconds=self.timeout_seconds,
        )
        async with contextlib.aclosing(stream) as items:
            async for item in items:
                return dict(item.data)
        raise OpenAIError("the pipeline finished without a video")

    async def _keep(
        self, video_id: str, job: dict[str, Any], steps: dict[str, int], work: asyncio.Task[Any]
    ) -> None:
        """While this replica holds the job: renew its lease, write its progress, and stop
        it when its client deletes it or another replica has taken it over."""
        written = 0
        while True:
            await asyncio.sleep(self.renew_every)
            try:
                held = await self.store.renew(video_id, self.owner, self.lease_ms)
                if not held or await self.store.cancelled(video_id):
                    work.cancel()
                    return
                if work.done():
                    continue  # waiting to queue it again: the lease is all there is to keep
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
        """Queues again each unfinished job that is neither queued nor held, and
        publishes how many jobs wait and for how long."""
        ids = await self.store.unfinished()
        jobs = await self.store.jobs(ids)
        gone, now = [], time.time()
        counts = {s: 0 for s in UNFINISHED}
        oldest = {s: 0.0 for s in UNFINISHED}
        live = []
        for video_id, job in zip(ids, jobs, strict=True):
            if job is None:
                gone.append(video_id)
                continue
            status = str(job["status"])
            if status not in UNFINISHED:
                continue
            counts[status] += 1
            oldest[status] = max(oldest[status], now - job["created_at"])
            if video_id not in self._running:
                live.append(video_id)
        # A few round trips whatever the queue's length; a claim only for a job that
        # looked unheld, which the claim itself checks again atomically.
        for video_id in await self.store.orphan_candidates(live):
            if await self.store.claim(video_id, self.owner, self.lease_ms):
                try:
                    await self._recover(video_id)
                finally:
                    await self.store.release(video_id, self.owner)
        await self.store.forget(gone)
        name = self.orchestrator.pipeline.name
        for status in UNFINISHED:
            self.metrics.video_jobs.labels(name, status).set(counts[status])
            self.metrics.video_job_age.labels(name, status).set(oldest[status])

    async def _recover(self, video_id: str) -> None:
        """A job claimed from a runner that went away: queued again, or failed."""
        job = await self.store.get(video_id)  # read again, now that it is held
        if job is None or job["status"] not in UNFINISHED:
            return
        runs = int(job.get(RUNS_FIELD, 0))
        if runs >= MAX_RUNS:
            lost = f"the router replica running this job went away {runs} times"
            await self._fail(job, "runner_lost", lost)
            return
        log.info("video job %s lost its runner; queued again", video_id)
        await self._queue_again(job)
