"""Live view of every stage's replicas: readiness and load from polling /ready,
plus what this router has dispatched and not yet seen finish."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from omnipipe.api import ResolvedPipeline
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.wire import WorkerStatus
from omnipipe.router.discovery import Discovery
from omnipipe.router.routing import ReplicaLoad, choose, choose_revision

log = logging.getLogger(__name__)


@dataclass
class Replica:
    url: str
    ready: bool = False
    reported_load: int = 0
    dispatched: int = 0
    transfer_address: str | None = None
    revision: str = ""

    def view(self) -> ReplicaLoad:
        return ReplicaLoad(
            self.url,
            self.ready,
            self.reported_load + self.dispatched,
            self.transfer_address,
            self.revision,
        )


class ReplicaPool:
    def __init__(
        self,
        pipeline: ResolvedPipeline,
        discovery: Discovery,
        client: httpx.AsyncClient,
        poll_interval: float,
        discovery_interval: float,
    ) -> None:
        self._pipeline = pipeline
        self._discovery = discovery
        self._client = client
        self._poll_interval = poll_interval
        self._discovery_interval = discovery_interval
        self._replicas: dict[str, dict[str, Replica]] = {s.name: {} for s in pipeline.stages}
        self._rotation = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self.generation = 0
        """The discovery generation the replica lists were last built from."""
        self.pipelines: dict[str, ResolvedPipeline] = {pipeline_revision(pipeline): pipeline}
        """Revision -> its resolved pipeline, for the revisions the router knows one of:
        its own and the one discovery names (see Orchestrator.serving_pipeline)."""

    async def start(self) -> None:
        await self._discover()
        await self._poll()
        self._tasks = [
            asyncio.create_task(self._every(self._discovery_interval, self._discover)),
            asyncio.create_task(self._every(self._poll_interval, self._poll)),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @staticmethod
    async def _every(seconds: float, action: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await action()
            except Exception:
                log.exception("replica refresh failed")

    async def _discover(self) -> None:
        await self._discovery.refresh()
        generation = self._discovery.generation()
        added: list[Replica] = []
        for stage, known in self._replicas.items():
            urls = set(await self._discovery.endpoints(stage))
            for url in urls - known.keys():
                known[url] = Replica(url)
                added.append(known[url])
            for url in known.keys() - urls:
                del known[url]
        # A new replica is polled before it counts as known, so that a caller who waits
        # for this generation sees its readiness and revision too.
        await asyncio.gather(*(self._poll_one(r) for r in added))
        # Kept while a replica still runs it: a rollout that has not switched yet.
        running = {r.revision for known in self._replicas.values() for r in known.values()}
        pipelines = {r: p for r, p in self.pipelines.items() if r in running}
        pipelines[pipeline_revision(self._pipeline)] = self._pipeline
        # Newest last: a reload that keeps the revision (new LoRA adapters) is named too.
        if (named := self._discovery.preferred_pipeline()) is not None:
            pipelines[pipeline_revision(named)] = named
        self.pipelines = pipelines
        self.generation = generation

    def adopt(self, pipeline: ResolvedPipeline) -> bool:
        """Takes a new version of the router's own pipeline file when it keeps the
        revision (its LoRA adapters changed): /v1/models and requests see it at once."""
        if pipeline_revision(pipeline) != pipeline_revision(self._pipeline):
            return False
        self._pipeline = pipeline
        self.pipelines[pipeline_revision(pipeline)] = pipeline
        return True

    def preferred_revisions(self, own: str) -> list[str]:
        """Newest first: the one discovery names (a local reload), then the router's own."""
        named = self._discovery.preferred_revision()
        return [named, own] if named and named != own else [own]

    async def _poll_one(self, replica: Replica) -> None:
        try:
            resp = await self._client.get(f"{replica.url}/ready", timeout=2.0)
            status = WorkerStatus.model_validate_json(resp.content)
        except (httpx.HTTPError, ValueError):
            replica.ready = False
            return
        replica.ready = status.ready
        replica.reported_load = status.running + status.waiting
        replica.transfer_address = status.transfer_address
        replica.revision = status.revision

    async def _poll(self) -> None:
        await asyncio.gather(
            *(self._poll_one(r) for known in self._replicas.values() for r in known.values())
        )

    async def refresh(self, stage: str) -> None:
        """Poll one stage's replicas now, rather than answer from a stale view."""
        await asyncio.gather(*(self._poll_one(r) for r in self._replicas[stage].values()))

    def urls(self, stage: str, ready_only: bool = False) -> list[str]:
        """The control URLs of the replicas of the stage discovery knows (the ready ones)."""
        return sorted(u for u, r in self._replicas[stage].items() if r.ready or not ready_only)

    def ready_revisions(self, stage: str) -> list[tuple[str, str]]:
        """(control URL, revision) of the stage's ready replicas (none for a stage this
        router's pipeline does not have: a reload may name new ones)."""
        known = self._replicas.get(stage, {})
        return sorted((u, r.revision) for u, r in known.items() if r.ready)

    def stage_ready(self, stage: str, revision: str | None = None) -> bool:
        """At least one replica of the stage (of that revision) is ready; it may be full."""
        return any(
            r.ready and (revision is None or r.revision == revision)
            for r in self._replicas[stage].values()
        )

    def ready_replicas(self, stage: str) -> int:
        """How many of the stage's replicas the last poll found ready (any revision)."""
        return sum(1 for r in self._replicas[stage].values() if r.ready)

    def revision_for(self, stages: list[str], max_load: int, preferred: list[str]) -> str | None:
        """The revision a request over these stages runs on (see choose_revision)."""
        views = {s: [r.view() for r in self._replicas[s].values()] for s in stages}
        return choose_revision(views, preferred, max_load)

    def pick(self, stage: str, max_load: int, revision: str | None = None) -> Replica | None:
        """The least-loaded ready replica of the stage, of that revision when one is given."""
        known = self._replicas[stage]
        views = [r.view() for r in known.values() if revision is None or r.revision == revision]
        chosen = choose(views, next(self._rotation), max_load)
        return known[chosen.url] if chosen else None

    def mark_down(self, replica: Replica) -> None:
        """Stop sending to a replica at once; the next successful poll brings it back."""
        replica.ready = False
