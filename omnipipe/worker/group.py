"""A colocated group's worker: several stages in one process (spec.placement).

Each stage keeps its own app, runtime, queue and batching, mounted at /stages/<stage>;
they hand tensors to each other by reference through one LocalExchange. The root serves
what belongs to the process: /health, /ready (every stage), /metrics (all stages'
series in one exposition) and /drain (the preStop hook).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from omnipipe.api import ResolvedPipeline
from omnipipe.api.placement import STAGE_PATH_PREFIX, Workload
from omnipipe.transfer.local import LocalExchange
from omnipipe.worker.metrics import MergedMetrics
from omnipipe.worker.server import Colocation, CredentialMiddleware, WorkerState, build_app
from omnipipe.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def build_group_app(
    pipeline: ResolvedPipeline,
    settings: WorkerSettings,
    group: Workload,
    transfer_ports: tuple[int, ...],
    teams: dict[str, int],
) -> FastAPI:
    """`teams`: each stage's threads (worker/threads.py: group_teams)."""
    if len(transfer_ports) != len(group.stages):
        raise ValueError(
            f"group {group.name}: {len(group.stages)} stages need {len(group.stages)} "
            f"transfer ports, got {len(transfer_ports)}"
        )
    colocation = Colocation(LocalExchange())
    members = {
        stage: build_app(
            pipeline,
            settings.model_copy(
                update={"stage": stage, "transfer_port": port, "threads": teams[stage]}
            ),
            colocation,
        )
        for stage, port in zip(group.stages, transfer_ports, strict=True)
    }
    states: list[WorkerState] = [app.state.worker for app in members.values()]
    registry = CollectorRegistry()
    registry.register(MergedMetrics([s.metrics.registry for s in states]))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for member in members.values():
                await stack.enter_async_context(member.router.lifespan_context(member))
            yield
            # Every stage stops taking work and finishes what it holds together, before
            # any closes: a stage's last hand-offs still find the next one listening,
            # and the drain takes one timeout, not one per stage.
            await _drain(states, settings.drain_timeout_seconds)

    app = FastAPI(title=f"omnipipe worker: {pipeline.name}/{group.name}", lifespan=lifespan)
    app.state.group = states
    for stage, member in members.items():
        app.mount(f"{STAGE_PATH_PREFIX}{stage}", member)
    if settings.credential:
        app.add_middleware(CredentialMiddleware, credential=settings.credential)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Ready when every stage is: one failure domain, so a stalled stage takes the
        process out of every stage's rotation."""
        statuses = [s.status() for s in states]
        body = {
            "group": group.name,
            "ready": all(s.ready for s in statuses),
            "stages": [s.model_dump() for s in statuses],
        }
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        for state in states:
            state.refresh_progress_gauge()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/drain")
    async def drain() -> dict[str, object]:
        """preStop hook: every stage stops taking work; returns once they hold none."""
        idle = await _drain(states, settings.drain_timeout_seconds)
        in_flight = sum(len(s.runtime.jobs) for s in states if s.runtime is not None)
        return {"drained": idle, "in_flight": in_flight}

    return app


async def _drain(states: list[WorkerState], seconds: float) -> bool:
    for state in states:
        state.draining = True
    idle = await asyncio.gather(
        *(s.runtime.wait_idle(seconds) for s in states if s.runtime is not None)
    )
    return all(idle)
