"""The worker's control API: submit, cancel, events, health, readiness, metrics, drain."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from omnipipe.api import ResolvedPipeline
from omnipipe.api.adapters import Adapter
from omnipipe.api.constants import CREDENTIAL_HEADER
from omnipipe.api.placement import STAGE_PATH_PREFIX
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.roles import Engine
from omnipipe.api.tracing import make_tracer
from omnipipe.api.wire import StageEvent, SubmitRequest, WorkerStatus, event_lines
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.stagekit.stage import Stage
from omnipipe.transfer import (
    Mailbox,
    Receiver,
    Sender,
    TransferStats,
    make_receiver,
    make_sender,
)
from omnipipe.transfer.local import LocalExchange, LocalFirstSender
from omnipipe.worker.adapters import AdapterControl, adapters_router, follow_pipeline_file
from omnipipe.worker.control import StageControl, control_router
from omnipipe.worker.metrics import WorkerMetrics
from omnipipe.worker.profiler import ProfileLimits
from omnipipe.worker.runtime import DuplicateRequest, StageRuntime
from omnipipe.worker.settings import WorkerSettings
from omnipipe.worker.stage_classes import stage_class, unimplemented_stages

log = logging.getLogger(__name__)
requests_log = logging.getLogger("omnipipe.worker.requests")
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# Probes and the Prometheus scrape carry no credential; they change nothing.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


def _stage_path(scope: Scope) -> str:
    """The path within a stage's API: a colocated stage's /ready is
    /stages/<stage>/ready to the client (its group's root sees that, its own app the
    path after its mount)."""
    path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
    if path.startswith(STAGE_PATH_PREFIX):
        path = "/" + path.removeprefix(STAGE_PATH_PREFIX).partition("/")[2]
    return path


class CredentialMiddleware:
    """Every other control call must carry the pipeline's credential: submit, cancel and
    drain change what the stage does, and only the router (or the pod's own preStop
    hook) may ask for that."""

    def __init__(self, app: ASGIApp, *, credential: str) -> None:
        self.app = app
        self.expected = credential.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _stage_path(scope) not in OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(CREDENTIAL_HEADER.lower().encode(), b"")
            if not hmac.compare_digest(given, self.expected):
                refused = JSONResponse(
                    {"detail": f"missing or wrong {CREDENTIAL_HEADER}"}, status_code=401
                )
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass
class Colocation:
    """What the stages of a colocated group share: the exchange their hand-offs to each
    other go through by reference, and a lock so that they load one at a time (vLLM
    sizes its cache from the memory free when it starts)."""

    exchange: LocalExchange
    load_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    failed: bool = False
    """A stage failed to load: the process is ending, so the others load nothing (a load
    thread cannot be cancelled, and the exit would wait for it)."""


@dataclass
class WorkerState:
    """Everything the routes share, created by the lifespan (no module globals)."""

    pipeline: ResolvedPipeline
    settings: WorkerSettings
    metrics: WorkerMetrics
    runtime: StageRuntime | None = None
    receiver: Receiver | None = None
    loaded: bool = False
    draining: bool = False
    load_error: str = ""
    background: set[asyncio.Task[None]] = field(default_factory=set)
    stop: Callable[[], None] = field(default=lambda: os.kill(os.getpid(), signal.SIGTERM))
    """Ends the server: its runner replaces this with a graceful exit of its own."""

    @property
    def revision(self) -> str:
        return pipeline_revision(self.pipeline)

    def stalled_for(self) -> float:
        """Seconds the engine has gone without progress, past the watchdog's limit; 0 if
        it is idle or moving."""
        idle = self.runtime.seconds_without_progress() if self.runtime else 0.0
        return idle if idle > self.settings.stall_seconds else 0.0

    def refresh_progress_gauge(self) -> None:
        """The watchdog's gauge, read as the scrape comes."""
        if self.runtime is not None:
            self.metrics.seconds_without_progress.labels(*self.metrics.labels).set(
                self.runtime.seconds_without_progress()
            )

    def status(self) -> WorkerStatus:
        rt = self.runtime
        stalled = self.stalled_for()
        if stalled:
            log.warning(
                "stage %s: engine stalled, no progress for %.0fs", self.settings.stage, stalled
            )
        return WorkerStatus(
            pipeline=self.pipeline.name,
            stage=self.settings.stage,
            ready=self.loaded and not self.draining and not stalled,
            draining=self.draining,
            running=rt.running if rt else 0,
            waiting=rt.waiting if rt else 0,
            transfer_address=self.receiver.address if self.receiver else None,
            revision=self.revision,
            message=self.load_error
            or (f"engine stalled: no progress for {stalled:.0f}s" if stalled else "")
            or ("draining" if self.draining else "ready" if self.loaded else "loading model"),
        )


def _device(settings: WorkerSettings, gpus: int) -> str:
    if settings.device != "auto":
        return settings.device
    return "cuda" if gpus > 0 and torch.cuda.is_available() else "cpu"


async def _new_stage(state: WorkerState, adapters: Sequence[Adapter] | None = None) -> Stage:
    """The stage's engine, loaded; with `adapters` in place of the spec's (a stage woken
    from sleep keeps the adapters it had)."""
    spec = state.pipeline.stage(state.settings.stage)
    if adapters is not None:
        spec = spec.model_copy(update={"adapters": tuple(adapters)})
    if missing := unimplemented_stages(state.pipeline):
        raise NotImplementedError(f"this worker cannot run: {', '.join(missing)}")
    # The operator's read-only weights mount when there is one (spec.weights). It holds
    # spec.model: a stage of a group that loads a model of its own downloads it.
    path = state.settings.model_path if spec.model == state.pipeline.model else None
    if path is None:
        path = await asyncio.to_thread(resolve_model_path, spec.model)
    stage = stage_class(spec, path, state.pipeline.pipeline)(
        spec, path, _device(state.settings, spec.gpus)
    )
    await asyncio.to_thread(stage.load)
    # Read now, inside the load's failure path: a family's limits that cannot be made
    # fail the load (and the worker exits), not the runtime's start later.
    stage.param_limits()
    return stage


async def _load_stage(state: WorkerState, colocation: Colocation | None) -> None:
    spec = state.pipeline.stage(state.settings.stage)
    started = time.monotonic()
    try:
        async with colocation.load_lock if colocation else contextlib.nullcontext():
            if colocation is not None and colocation.failed:
                return
            stage = await _new_stage(state)
    except Exception as exc:
        log.exception("loading stage %s failed; exiting", spec.name)
        state.load_error = f"load failed: {exc}"
        if colocation is not None:
            colocation.failed = True
        # A worker that cannot load must not sit unready forever: exit, so Kubernetes
        # (CrashLoopBackOff) or `omnipipe serve` (restart, then give up) shows it.
        state.stop()
        return
    assert state.runtime is not None
    if (table := stage.kv_block_table()) is not None and state.receiver is not None:
        # Sized by the model, so known only now; nothing is sent here before /ready.
        state.receiver.block_table = table
    state.runtime.load(stage)
    state.loaded = True
    log.info(
        "stage %s ready in %.1fs (model %s)", spec.name, time.monotonic() - started, spec.model
    )


async def _sweep(mailbox: Mailbox, every_seconds: float = 30.0) -> None:
    """Chunks for requests that never started here (cancelled first) expire."""
    while True:
        await asyncio.sleep(every_seconds)
        if dropped := mailbox.sweep():
            log.info("dropped the inputs of %d requests nobody claimed", dropped)


def build_app(
    pipeline: ResolvedPipeline, settings: WorkerSettings, colocation: Colocation | None = None
) -> FastAPI:
    """One stage's worker; with `colocation`, one of a group's stages in a shared process
    (omnipipe/worker/group.py mounts it under /stages/<stage>)."""
    spec = pipeline.stage(settings.stage)  # fails fast on an unknown stage
    state = WorkerState(
        pipeline,
        settings,
        WorkerMetrics.create(
            pipeline.name,
            spec.name,
            engine_metrics=colocation is None or spec.engine is Engine.VLLM,
        ),
    )
    tracer = make_tracer(pipeline.tracing, f"omnipipe-{spec.name}", pipeline.name, spec.name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend = pipeline.transfer.backend.value
        mailbox = Mailbox(max_bytes=settings.mailbox_max_bytes)
        in_stats = TransferStats(
            lambda n, s: state.metrics.transfer("in", n, s),
            lambda: state.metrics.count_frame("in"),
        )
        state.receiver = make_receiver(
            backend,
            mailbox,
            settings.host,
            settings.transfer_port,
            settings.advertise_host,
            in_stats,
            settings.credential,
        )
        await state.receiver.start()
        out_stats = TransferStats(
            lambda n, s: state.metrics.transfer("out", n, s),
            lambda: state.metrics.count_frame("out"),
        )
        sender: Sender = make_sender(backend, out_stats, settings.credential)
        if colocation is not None:
            # The transfer_* series count what crossed a socket; the sender counts local ones.
            colocation.exchange.register(state.receiver.address, mailbox)
            sender = LocalFirstSender(
                sender, colocation.exchange, out_stats, on_local=state.metrics.count_local_handoff
            )
        state.runtime = StageRuntime(
            spec.name,
            None,
            mailbox,
            sender,
            state.metrics,
            settings.max_batch or spec.max_batch,
            spec.batch_wait_ms / 1000,
            tracer.tracer,
            # Alone in its process the process-wide budget fits the stage already.
            threads=settings.threads if colocation is not None else None,
        )
        log.info(
            "stage %s: transfer %s listening at %s", spec.name, backend, state.receiver.address
        )
        loader = asyncio.create_task(_load_stage(state, colocation))
        state.background.add(loader)
        sweeper = asyncio.create_task(_sweep(mailbox))
        follower = asyncio.create_task(follow_pipeline_file(Path(settings.pipeline_file), adapters))
        try:
            yield
        finally:
            state.draining = True
            await state.runtime.wait_idle(settings.drain_timeout_seconds)
            loader.cancel()
            sweeper.cancel()
            follower.cancel()
            await control.profiler.close()
            await state.runtime.close()
            if colocation is not None:
                colocation.exchange.unregister(state.receiver.address)
            await sender.close()
            await state.receiver.close()
            await asyncio.to_thread(tracer.close)

    adapters = AdapterControl(
        spec.name, lambda: state.runtime if state.loaded else None, spec.adapters
    )

    async def reload_stage() -> Stage:
        """A stage woken from sleep, with the adapters the worker has now."""
        wanted = list(adapters.loaded)
        stage = await _new_stage(state, wanted)
        if adapters.loaded != wanted:  # changed while it loaded
            await asyncio.to_thread(stage.set_adapters, list(adapters.loaded))
        return stage

    control = StageControl(
        spec.name,
        lambda: state.runtime if state.loaded else None,
        reload_stage,
        settings.drain_timeout_seconds,
        Path(settings.profile_dir),
        ProfileLimits(settings.profile_max_seconds, settings.profile_max_megabytes << 20),
    )
    app = FastAPI(title=f"omnipipe worker: {pipeline.name}/{spec.name}", lifespan=lifespan)
    app.state.worker = state
    app.include_router(adapters_router(adapters))
    app.include_router(control_router(control))
    if settings.credential:
        app.add_middleware(CredentialMiddleware, credential=settings.credential)
    else:
        log.warning("no %s: the control API takes calls from anyone", CREDENTIAL_HEADER)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        status = state.status()
        return JSONResponse(status.model_dump(), status_code=200 if status.ready else 503)

    @app.post("/drain")
    async def drain() -> dict[str, object]:
        """preStop hook: stop taking work, return once in-flight requests are done. A
        POST with the credential: it takes the stage out of service for good."""
        state.draining = True
        idle = (
            await state.runtime.wait_idle(settings.drain_timeout_seconds) if state.runtime else True
        )
        return {"drained": idle, "in_flight": len(state.runtime.jobs) if state.runtime else 0}

    @app.get("/metrics")
    async def metrics() -> Response:
        state.refresh_progress_gauge()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/requests")
    async def submit(
        request: SubmitRequest,
        traceparent: Annotated[str, Header(max_length=128)] = "",
    ) -> StreamingResponse:
        """Accept a request and stream its events (NDJSON) until done or error. If the
        caller goes away, the request is cancelled: nothing runs for nobody. The W3C
        traceparent header names the router's span, the parent of this stage's spans."""
        if not state.loaded or state.draining or state.runtime is None:
            raise HTTPException(503, detail=state.status().message)
        try:
            job = state.runtime.submit(request, traceparent)
        except DuplicateRequest:
            raise HTTPException(409, detail=f"request {request.request_id} exists") from None
        # One line per request and stage, with the revision: what shows that no request
        # ever runs on two revisions.
        requests_log.info(
            "request %s stage %s revision %s", request.request_id, spec.name, state.revision
        )

        async def stream() -> AsyncIterator[bytes]:
            finished = False
            try:
                while True:
                    event: StageEvent = await job.events.get()
                    for line in event_lines(event):
                        yield line
                    if event.type in ("done", "error"):
                        finished = True
                        return
            finally:
                if not finished and job.task is not None:
                    job.task.cancel()

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request_id: str) -> dict[str, bool]:
        return {"cancelled": state.runtime.cancel(request_id) if state.runtime else False}

    return app
