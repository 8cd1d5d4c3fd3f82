"""build_app(pipeline, settings) -> FastAPI. The lifespan owns clients and watchers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from omnipipe.api import ResolvedPipeline
from omnipipe.api.constants import CREDENTIAL_HEADER, UPSTREAM_KEEP_ALIVE_SECONDS
from omnipipe.api.loading import new_versions
from omnipipe.api.pipeline_traits import keeps_voices, makes_audio, makes_video
from omnipipe.api.roles import Role
from omnipipe.api.tracing import make_tracer
from omnipipe.router.api.admin import AdminService, admin_router
from omnipipe.router.api.audio_generate import (
    AudioGenerateRequest,
    audio_generate_router,
    audio_only_router,
)
from omnipipe.router.api.chat import ChatRequest, chat_router
from omnipipe.router.api.common import error_param, stage_with_role
from omnipipe.router.api.edits import ImageEditRequest, edits_router
from omnipipe.router.api.generate import GenerateRequest, generate_router
from omnipipe.router.api.images import ImageGenerationRequest, images_router
from omnipipe.router.api.models import model_ids, models_router
from omnipipe.router.api.speech import SpeechRequest, speech_router
from omnipipe.router.api.speech_stream import speech_stream_router
from omnipipe.router.api.video_only import video_only_router
from omnipipe.router.api.videos import VideoCreateRequest, videos_router
from omnipipe.router.api.voices import voices_router
from omnipipe.router.discovery import Discovery, DnsDiscovery, StaticDiscovery
from omnipipe.router.errors import (
    BadRequest,
    OpenAIError,
    http_error_handler,
    internal_error_handler,
    openai_error_handler,
)
from omnipipe.router.metrics import RouterMetrics
from omnipipe.router.middleware import GuardMiddleware
from omnipipe.router.orchestrator import Orchestrator
from omnipipe.router.replicas import ReplicaPool
from omnipipe.router.settings import RouterSettings
from omnipipe.router.stage_limits import KnownLimits
from omnipipe.router.videos.runner import VideoRunner
from omnipipe.router.videos.store import VideoStore
from omnipipe.router.voice_store import VoiceStore

log = logging.getLogger(__name__)

# The request bodies the /v1 routes parse themselves (leniently); the OpenAPI document
# describes them under components/schemas.
BODY_MODELS: tuple[type[BaseModel], ...] = (
    ImageGenerationRequest,
    ImageEditRequest,
    ChatRequest,
    SpeechRequest,
    GenerateRequest,
    VideoCreateRequest,
    AudioGenerateRequest,
)


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in BODY_MODELS:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        app.openapi_schema = document
    return app.openapi_schema


def _discovery(pipeline: ResolvedPipeline, settings: RouterSettings) -> Discovery:
    if settings.replicas_file:
        return StaticDiscovery.from_file(settings.replicas_file)
    return DnsDiscovery(pipeline, settings.cluster_domain)


def _video_runner(
    pipeline: ResolvedPipeline,
    settings: RouterSettings,
    orchestrator: Orchestrator,
    metrics: RouterMetrics,
) -> VideoRunner | None:
    """A video pipeline's job runner; None for the other pipelines."""
    if not makes_video(pipeline.pipeline):
        return None
    if settings.video_store is None:
        raise ValueError(
            f"pipeline {pipeline.name} makes videos, whose jobs the router keeps in Redis: "
            "set OMNIPIPE_ROUTER_VIDEO_STORE (redis://host:6379/0; on Kubernetes, the "
            "pipeline's spec.videos.storeSecretRef or the chart's operator.videoStore)"
        )
    return VideoRunner(
        VideoStore(
            settings.video_store,
            pipeline.namespace,
            pipeline.name,
            max_unfinished=pipeline.videos.max_unfinished_jobs,
        ),
        orchestrator,
        metrics,
        ttl_seconds=pipeline.videos.ttl_seconds,
        concurrency=settings.video_jobs_per_replica,
        timeout_seconds=settings.video_timeout_seconds,
        lease_seconds=settings.video_lease_seconds,
        max_bytes=settings.video_max_bytes,
    )


def build_app(pipeline: ResolvedPipeline, settings: RouterSettings) -> FastAPI:
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256)
    )
    pool = ReplicaPool(
        pipeline,
        _discovery(pipeline, settings),
        client,
        settings.poll_interval_seconds,
        settings.discovery_interval_seconds,
    )
    router_metrics = RouterMetrics.create()
    tracer = make_tracer(pipeline.tracing, "omnipipe-router", pipeline.name)
    for stage in pipeline.stages:
        # Zero demand must read as 0, not as an absent series.
        router_metrics.pending.labels(pipeline.name, stage.name).set(0)
    orchestrator = Orchestrator(
        pipeline,
        pool,
        settings.request_timeout_seconds,
        settings.max_queue_per_replica,
        router_metrics,
        settings.wake_wait_seconds,
    )

    videos = _video_runner(pipeline, settings, orchestrator, router_metrics)
    voices = (
        VoiceStore(settings.video_store, pipeline.namespace, pipeline.name, settings.max_voices)
        if keeps_voices(pipeline.pipeline) and settings.video_store
        else None
    )

    async def follow_pipeline_file() -> None:
        async for new in new_versions(Path(settings.pipeline_file)):
            if pool.adopt(new):
                names = ", ".join(a.name for a in new.adapters) or "none"
                log.info("pipeline file changed: LoRA adapters now %s", names)
            else:
                log.info("pipeline file changed to another revision: the operator rolls it")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        follower = asyncio.create_task(follow_pipeline_file())
        credential = settings.pipeline_credential
        orchestrator.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=4096, limit_per_host=0, keepalive_timeout=UPSTREAM_KEEP_ALIVE_SECONDS
            ),
            headers={CREDENTIAL_HEADER: credential} if credential else None,
        )
        if videos is not None:
            await videos.start()
        try:
            yield
        finally:
            follower.cancel()
            if videos is not None:
                await videos.close()
            if voices is not None:
                await voices.close()
            await pool.close()
            await orchestrator.session.close()
            await client.aclose()
            await asyncio.to_thread(tracer.close)

    app = FastAPI(title=f"omnipipe router: {pipeline.name}", lifespan=lifespan)
    app.state.videos = videos
    app.add_exception_handler(OpenAIError, openai_error_handler)
    app.add_exception_handler(HTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    app.add_middleware(
        GuardMiddleware,
        pipeline=pipeline.name,
        api_key=settings.api_key,
        admin_api_key=settings.admin_api_key,
        max_body_bytes=settings.max_body_bytes,
        metrics=router_metrics,
        tracer=tracer.tracer,
    )

    @app.exception_handler(ClientDisconnect)
    async def gone(_request: Request, _exc: ClientDisconnect) -> JSONResponse:
        # The client hung up mid-body: nobody reads this answer, but the metrics and the
        # log count it as the client's doing, not as a router error with a traceback.
        return BadRequest("the client went away before its request body arrived").response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        # FastAPI's loc starts with where the value came from (body, query, path).
        param = error_param(tuple(err.get("loc", ()))[1:], err.get("type") == "missing")
        message = str(err.get("msg", "invalid request"))
        return BadRequest(f"{param}: {message}" if param else message, param=param).response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        stages = {s.name: pool.stage_ready(s.name) for s in pipeline.stages}
        # A stage at zero replicas wakes for a request the router holds, so the router
        # must take requests (be in its Service) while such a stage has no replica.
        serving = all(
            stages[s.name] or (s.wakes_on_demand and settings.wake_wait_seconds > 0)
            for s in pipeline.stages
        )
        body = {
            "ready": serving,
            "stages": stages,
            # What `omnipipe serve` waits for on a reload: the revision new requests
            # start on, and the replicas-file generation behind it.
            "revision": orchestrator.serving_revision(),
            "discovery": pool.generation,
            # What `omnipipe serve` waits for before it says ready: every replica it started
            # routed to, not only the first of each stage.
            "replicas": {s.name: pool.ready_replicas(s.name) for s in pipeline.stages},
        }
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router_metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def serving_ids() -> set[str]:
        # Those of the revision new requests start on: a reload may change the model.
        return model_ids(orchestrator.serving_pipeline())

    app.include_router(models_router(orchestrator.serving_pipeline, int(time.time())))
    credential = settings.pipeline_credential
    admin = AdminService(
        orchestrator.serving_pipeline,
        pool,
        client,
        {CREDENTIAL_HEADER: credential} if credential else {},
        local=settings.replicas_file is not None,
    )
    if voices is not None:
        voices.make_prompt = admin.voice_prompt
    if videos is not None:
        known = KnownLimits(pool, client, {CREDENTIAL_HEADER: credential} if credential else {})
        app.include_router(videos_router(orchestrator, serving_ids, videos, known))
        app.include_router(video_only_router(pipeline))
    elif makes_audio(pipeline.pipeline):
        app.include_router(audio_generate_router(orchestrator, serving_ids))
        app.include_router(audio_only_router(pipeline))
    else:
        app.include_router(images_router(orchestrator, serving_ids))
        app.include_router(edits_router(orchestrator, serving_ids))
        app.include_router(chat_router(pipeline, orchestrator, serving_ids))
        app.include_router(speech_router(pipeline, orchestrator, serving_ids, voices))
        app.include_router(
            speech_stream_router(pipeline, orchestrator, serving_ids, voices, admin.preset_voices)
        )
        if stage_with_role(pipeline, Role.TALKER) is not None:
            app.include_router(voices_router(voices, admin.preset_voices))
        app.include_router(generate_router(pipeline, orchestrator, serving_ids, voices))
    app.include_router(admin_router(admin))
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app
