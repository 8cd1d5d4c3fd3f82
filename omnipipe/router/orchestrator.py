"""One request through the stage graph: choose replicas, submit to all at once, read
every stage's event stream, and cancel everything on the first failure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Iterable
from typing import Any, cast

import aiohttp
from opentelemetry import trace

from omnipipe.api import ResolvedPipeline
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.roles import Role
from omnipipe.api.tracing import traceparent_of
from omnipipe.api.wire import Destination, SubmitRequest
from omnipipe.router.errors import GatewayTimeout, Overloaded, StageUnavailable
from omnipipe.router.metrics import RouterMetrics
from omnipipe.router.outputs import Output, OutputPart, Progress, StageDone
from omnipipe.router.replicas import Replica, ReplicaPool
from omnipipe.router.stage_calls import (
    ReplicaDeclined,
    cancel_request,
    first_failure,
    stream_stage,
)

log = logging.getLogger(__name__)
# Events a request holds between its stage streams and its client. Bounded, so a slow
# client slows the stage stream (TCP back-pressure) instead of growing the router.
SINK_EVENTS = 16


# How many times a request is planned again on other replicas when one it chose never
# took it (gone, or draining), before any output: a rollout or a scale-down retires
# replicas the router may still have picked in the second before its next poll.
REPLANS = 2


class Orchestrator:
    def __init__(
        self,
        pipeline: ResolvedPipeline,
        pool: ReplicaPool,
        timeout: float,
        max_load: int,
        metrics: RouterMetrics,
        wake_wait: float,
    ) -> None:
        self.pipeline = pipeline
        self.pool = pool
        # Stage calls are the router's hot path: aiohttp costs a fraction of httpx per
        # request. Made in the app's lifespan (it needs the running loop).
        self.session: aiohttp.ClientSession | None = None
        self.timeout = timeout
        self.max_load = max_load
        self.metrics = metrics
        self.wake_wait = wake_wait
        # The revision the router was configured with is the newest it knows of (in
        # Kubernetes its ConfigMap is the update revision's), unless discovery names a
        # newer one (`omnipipe serve` after a reload).
        self.own_revision = pipeline_revision(pipeline)
        self._consumers = {
            s.name: [d.name for d in pipeline.stages if s.name in d.inputs] for s in pipeline.stages
        }

    @property
    def preferred(self) -> list[str]:
        return self.pool.preferred_revisions(self.own_revision)

    def serving_revision(self) -> str | None:
        """The revision a request over every stage would start on now."""
        return self.pool.revision_for(
            [s.name for s in self.pipeline.stages], self.max_load, self.preferred
        )

    def serving_pipeline(self) -> ResolvedPipeline:
        """The resolved pipeline of the revision new requests start on (with none whole,
        the newest): the model /v1/models lists and requests may name. A reload of
        `omnipipe serve` may change the model, never the stage graph, so requests are
        planned over self.pipeline's graph whichever revision they run on."""
        revision = self.serving_revision() or self.preferred[0]
        return self.pool.pipelines.get(revision, self.pipeline)

    async def _wait_for_replica(
        self, stage: str, revision: str | None, stages: list[str] | None = None
    ) -> Replica | str | None:
        """Hold the request while the stage wakes (its demand is exported as
        omnipipe_router_pending_requests, which the autoscaler reads), bounded. Given
        the request's `stages`, stop waiting for a revision's replica as soon as another
        revision is whole, and name it: in a rollout the old revision loses its pods
        for good, and the new one may be whole only a moment after the first look."""
        # Polls lag by up to a second: look again before anything else.
        await self.pool.refresh(stage)
        replica = self.pool.pick(stage, self.max_load, revision)
        if replica is not None or self.pool.stage_ready(stage, revision) or self.wake_wait <= 0:
            return replica
        gauge = self.metrics.pending.labels(self.pipeline.name, stage)
        gauge.inc()
        try:
            deadline = asyncio.get_running_loop().time() + self.wake_wait
            while asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.5)
                await self.pool.refresh(stage)
                replica = self.pool.pick(stage, self.max_load, revision)
                if replica is not None:
                    return replica
                if stages is not None and revision is not None:
                    whole = self.pool.revision_for(stages, self.max_load, self.preferred)
                    if whole is not None and whole != revision:
                        return whole
            return None
        finally:
            gauge.dec()

    @property
    def stages(self) -> list[str]:
        return [s.name for s in self.pipeline.stages]

    @property
    def outputs(self) -> list[str]:
        """The stages whose results a whole-pipeline request answers with."""
        return list(self.pipeline.outputs)

    def needed(self, emitters: Iterable[str]) -> list[str]:
        """The emitting stages and everything upstream of them, in pipeline order."""
        wanted = set(emitters)
        for stage in reversed(self.pipeline.stages):
            if stage.name in wanted:
                wanted.update(stage.inputs)
        return [s.name for s in self.pipeline.stages if s.name in wanted]

    async def _choose(self, stages: list[str]) -> dict[str, Replica]:
        """One replica per stage, all of one revision: tensors only ever pass between
        replicas that agree on what they hand each other. With no revision whole yet
        (a stage waking from zero), the first replica found pins the rest."""
        revision = self.pool.revision_for(stages, self.max_load, self.preferred)
        for _ in range(REPLANS):
            chosen = await self._choose_on(stages, revision, switch=True)
            if isinstance(chosen, dict):
                return chosen
            revision = chosen
        plan = await self._choose_on(stages, revision, switch=False)
        assert isinstance(plan, dict)
        return plan

    async def _choose_on(
        self, stages: list[str], revision: str | None, switch: bool
    ) -> dict[str, Replica] | str:
        """The replicas of `revision`, or (switch) another revision that is whole when
        this one has lost a stage: a rollout retires the old revision's pods one by one,
        and a request must not wait for one that will not come back."""
        chosen: dict[str, Replica] = {}
        for stage in (self.pipeline.stage(name) for name in stages):
            replica = self.pool.pick(stage.name, self.max_load, revision)
            if replica is None and switch:
                await self.pool.refresh(stage.name)
                whole = self.pool.revision_for(stages, self.max_load, self.preferred)
                if whole is not None and whole != revision:
                    return whole
            if replica is None:
                waited = await self._wait_for_replica(
                    stage.name, revision, stages if switch else None
                )
                if isinstance(waited, str):
                    return waited
                replica = waited
            if replica is None:
                of = f" of revision {revision}" if revision else ""
                if self.pool.stage_ready(stage.name, revision):
                    raise Overloaded(
                        f"every {stage.name} replica{of} is at capacity; retry later",
                        retry_after=1,
                    )
                raise StageUnavailable(
                    f"stage {stage.name} has no ready replica{of} (waited {self.wake_wait:g}s)",
                    retry_after=5,
                )
            revision = replica.revision
            chosen[stage.name] = replica
        return chosen

    async def stream(
        self,
        params: dict[str, dict[str, Any]],
        emitters: set[str],
        on_progress: Progress | None = None,
        limit_seconds: float | None = None,
    ) -> AsyncGenerator[Output]:
        """Run the emitters and their upstream stages; yield the emitters' whole results
        as they arrive. Closing the iterator early (a client gone) cancels every stage.
        on_progress hears the denoiser's steps (stage, step, steps); limit_seconds replaces
        the router's request timeout (a video job's run is not a client's wait)."""
        run = self._run(
            params, emitters, whole=True, on_progress=on_progress, limit_seconds=limit_seconds
        )
        async with contextlib.aclosing(run) as items:
            async for item in items:
                assert isinstance(item, Output)
                yield item

    def stream_parts(
        self,
        params: dict[str, dict[str, Any]],
        emitters: set[str],
        usage: Counter[str] | None = None,
    ) -> AsyncGenerator[Output | OutputPart]:
        """As stream(), but a result's long fields arrive in pieces (OutputParts, in order)
        before its Output, so that no result is ever held whole. Once the last stage is
        done, `usage` holds what the stages counted of the request, added up."""
        return cast(
            AsyncGenerator[Output | OutputPart],
            self._run(params, emitters, whole=False, usage=usage),
        )

    def stream_stages(
        self, params: dict[str, dict[str, Any]], emitters: set[str]
    ) -> AsyncGenerator[Output | OutputPart | StageDone]:
        """As stream_parts(), and each emitting stage's end is told (StageDone)."""
        return self._run(params, emitters, whole=False, stage_done=True)

    async def _run(
        self,
        params: dict[str, dict[str, Any]],
        emitters: set[str],
        whole: bool,
        stage_done: bool = False,
        on_progress: Progress | None = None,
        limit_seconds: float | None = None,
        usage: Counter[str] | None = None,
    ) -> AsyncGenerator[Output | OutputPart | StageDone]:
        """_attempt(), planned again (fresh request id, the refusing replica marked down)
        when a replica declines it before anything reached the client."""
        for replan in range(REPLANS + 1):
            started = False
            try:
                async with contextlib.aclosing(
                    self._attempt(
                        params, emitters, whole, stage_done, on_progress, limit_seconds, usage
                    )
                ) as items:
                    async for item in items:
                        started = True
                        yield item
                return
            except ReplicaDeclined as exc:
                if started or replan == REPLANS:
                    raise
                log.info("planning the request again: %s", exc)

    async def _attempt(
        self,
        params: dict[str, dict[str, Any]],
        emitters: set[str],
        whole: bool,
        stage_done: bool,
        on_progress: Progress | None,
        limit_seconds: float | None = None,
        usage: Counter[str] | None = None,
    ) -> AsyncGenerator[Output | OutputPart | StageDone]:
        timeout = limit_seconds or self.timeout
        # This attempt's counts, added to `usage` only once it succeeds: an attempt that
        # is planned again must not count twice.
        counted: Counter[str] = Counter()
        stages = self.needed(emitters)
        request_id = uuid.uuid4().hex
        # The span the router's middleware made current for this request.
        traceparent = traceparent_of(trace.get_current_span())
        chosen = await self._choose(stages)
        session = self.session
        assert session is not None
        sink: asyncio.Queue[Output | OutputPart | StageDone] = asyncio.Queue(SINK_EVENTS)
        tasks: list[asyncio.Task[None]] = []
        getter: asyncio.Future[Output | OutputPart | StageDone] | None = None
        finished = False
        for replica in chosen.values():
            replica.dispatched += 1
        try:
            for name in stages:
                stage = self.pipeline.stage(name)
                outputs = [
                    Destination(stage=d, address=str(chosen[d].transfer_address))
                    for d in self._consumers[name]
                    if d in chosen
                ]
                submit = SubmitRequest(
                    request_id=request_id,
                    params=params.get(name, {}),
                    inputs=list(stage.inputs),
                    outputs=outputs,
                    emit=name in emitters,
                    timeout_seconds=timeout,
                    progress=on_progress is not None and stage.role is Role.DENOISER,
                )
                tasks.append(
                    asyncio.create_task(
                        stream_stage(
                            session,
                            self.pool,
                            name,
                            chosen[name],
                            submit,
                            sink,
                            whole=whole,
                            traceparent=traceparent,
                            on_progress=on_progress,
                            limit_seconds=timeout,
                        )
                    )
                )
            remaining = len(tasks)
            # A deadline checked around each wait, not asyncio.timeout(): this generator is
            # resumed from another task than the one that started it (a streamed response
            # reads the first output in the handler, the rest in Starlette's task), and
            # asyncio.timeout() would cancel the task that entered it, dropping the
            # client's connection instead of answering 504.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while remaining:
                left = deadline - loop.time()
                if left <= 0:
                    raise GatewayTimeout(f"request took longer than {timeout:g}s")
                getter = getter or asyncio.ensure_future(sink.get())
                waits: set[asyncio.Future[Any]] = {getter, *(t for t in tasks if not t.done())}
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if failed := await first_failure(tasks):
                    raise failed
                if getter.done():
                    item, getter = getter.result(), None
                    if isinstance(item, StageDone):
                        remaining -= 1
                        counted.update(item.usage)
                        if stage_done and item.stage in emitters:
                            yield item
                    else:
                        yield item
            finished = True
            if usage is not None:
                usage.update(counted)
        finally:
            for task in tasks:
                task.cancel()
            if getter is not None:
                getter.cancel()
            if not finished:
                await asyncio.shield(cancel_request(session, request_id, chosen.values()))
            for replica in chosen.values():
                replica.dispatched -= 1
