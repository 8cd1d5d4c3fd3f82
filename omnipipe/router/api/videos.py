"""/v1/videos: OpenAI's asynchronous video API on a text-to-video stage graph. A POST
creates a job and answers at once; the client polls GET /v1/videos/{id} (status, and
progress from the denoiser's steps) and downloads GET /v1/videos/{id}/content. Jobs live
in the store every router replica shares (router/videos)."""

from __future__ import annotations

import json
import logging
import random
import re
import time
import uuid
from collections.abc import Callable
from hashlib import sha256
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from omnipipe.api.param_limits import exceeded
from omnipipe.api.plain_text import shown
from omnipipe.router.api.byte_ranges import BodyGone, ranged
from omnipipe.router.api.common import (
    bad_request,
    check_model,
    family_requests,
    json_body,
    request_fields,
    with_family_checks,
)
from omnipipe.router.errors import BadRequest, Conflict, ModelNotFound, Overloaded
from omnipipe.router.orchestrator import Orchestrator
from omnipipe.router.redis_store import StoreUnavailable
from omnipipe.router.stage_limits import KnownLimits
from omnipipe.router.videos.runner import UNFINISHED, VideoRunner, public
from omnipipe.router.videos.store import KeyReused, QueueFull

log = logging.getLogger(__name__)

VIDEO_ID = re.compile(r"video_[0-9a-f]{32}")
MAX_FORM_FIELDS = 32
MAX_IDEMPOTENCY_KEY = 255
# A full queue drains at the pace of whole videos: a client retries in a minute, not at once.
QUEUE_FULL_RETRY_SECONDS = 60


class VideoCreateRequest(BaseModel):
    """JSON or a multipart form. Lenient: unknown fields are accepted and logged."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    prompt: str = Field(min_length=1, max_length=32_000)
    model: str | None = None
    """The pipeline's model id; the pipeline's own when left out."""
    seconds: str | float | None = None
    """Duration; num_frames, when given, decides instead."""
    size: str | None = None
    """WIDTHxHEIGHT."""
    seed: int | None = Field(default=None, ge=0, lt=2**63)


def idempotency(
    request: Request, model: str, params: dict[str, Any], body: VideoCreateRequest
) -> tuple[str, str] | None:
    """(digest of the request's Idempotency-Key, fingerprint of what it asks for), or
    None when it sent none. The fingerprint is of the parameters as the stages get them,
    so one request sent as JSON and again as a form ("4" or 4.0 seconds) is the same; the
    seed counts only when the client chose it."""
    keys = request.headers.getlist("idempotency-key")
    if not keys:
        return None
    if len(keys) > 1:
        # Which one a proxy or the client meant is not ours to guess.
        raise BadRequest("send one Idempotency-Key header, not several", param="Idempotency-Key")
    [key] = keys
    if not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY or not key.isprintable():
        raise BadRequest(
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable characters",
            param="Idempotency-Key",
        )
    # params carries the seed drawn for a client that chose none: the client's own counts.
    asked = {**params, "model": model, "seed": body.seed}
    asked_json = json.dumps(asked, sort_keys=True, default=str)
    return sha256(key.encode()).hexdigest(), sha256(asked_json.encode()).hexdigest()


class VideoNotFound(ModelNotFound):
    """404, in OpenAI's shape (the type ModelNotFound gives it)."""


def _no_reference() -> BadRequest:
    return BadRequest(
        "input_reference: this pipeline makes video from text only", param="input_reference"
    )


async def _fields(request: Request) -> tuple[dict[str, Any], bool]:
    """The body's fields, and whether they came as a form (whose values are all text)."""
    if request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        try:
            form = await request.form(max_files=2, max_fields=MAX_FORM_FIELDS)
        except HTTPException as exc:
            raise BadRequest(f"malformed multipart form: {exc.detail}") from None
        try:
            for key, value in form.multi_items():
                if key == "input_reference":
                    raise _no_reference()
                if isinstance(value, UploadFile):
                    raise BadRequest(f"{key}: a file where a text field belongs", param=key)
            return {k: v for k, v in form.multi_items() if isinstance(v, str)}, True
        finally:
            await form.close()
    given = request.headers.get("content-type", "")
    kind = given.split(";")[0].strip().lower()
    json_kind = kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )
    if kind and not json_kind:
        # As the JSON endpoints (FastAPI's body parsing) answer: curl's -d alone sends
        # application/x-www-form-urlencoded, which is not read as JSON either.
        raise BadRequest(
            f"Content-Type {given[:60]!r}: send application/json or multipart/form-data"
        )
    try:
        doc = json.loads(await request.body())
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        raise BadRequest("the body must be JSON or a multipart form") from None
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object")
    if doc.get("input_reference") is not None:
        raise _no_reference()
    return doc, False


def _video_id(video_id: str) -> str:
    if not VIDEO_ID.fullmatch(video_id):
        raise VideoNotFound(f"video {shown(video_id)} does not exist", param="video_id")
    return video_id


def videos_router(
    orchestrator: Orchestrator,
    model_ids: Callable[[], set[str]],
    runner: VideoRunner,
    limits: KnownLimits,
) -> APIRouter:
    router = APIRouter()
    store = runner.store

    async def found(video_id: str) -> dict[str, Any]:
        job = await store.get(_video_id(video_id))
        if job is None:
            raise VideoNotFound(f"video {shown(video_id)} does not exist", param="video_id")
        return job

    @router.post("/v1/videos", response_model=None, openapi_extra=json_body(VideoCreateRequest))
    async def create(request: Request) -> dict[str, Any]:
        fields, as_form = await _fields(request)
        try:
            # A JSON body's numbers are numbers: "10" or true is refused, as OpenAI does.
            body = VideoCreateRequest.model_validate(fields, strict=not as_form)
        except ValidationError as exc:
            raise bad_request(exc, fields) from None
        model = body.model or orchestrator.pipeline.name
        check_model(model, model_ids())
        extensions = family_requests(orchestrator.pipeline)
        video_params = getattr(extensions, "video_params", None)
        if video_params is None:
            raise BadRequest(f"model {shown(model)} does not make videos", param="model")
        params = with_family_checks(lambda: video_params(request_fields(body)))
        unread = sorted(set(body.model_extra or {}) - getattr(extensions, "video_fields", set()))
        if unread:
            log.info("ignoring unknown video fields: %s", ", ".join(shown(k) for k in unread[:20]))
        seed = body.seed if body.seed is not None else random.randrange(2**31)
        params.update(prompt=body.prompt, seed=seed)
        # The loaded model's own bounds (a DiT's positions), before the job is queued.
        stages = [s.name for s in orchestrator.pipeline.stages]
        revision = orchestrator.serving_revision() or orchestrator.preferred[0]
        if (limit := exceeded(params, await limits.of(stages, revision))) is not None:
            # The field the client set: num_frames itself, or seconds that made it.
            field = limit.param if fields.get(limit.param) not in (None, "") else limit.field
            raise BadRequest(limit.refusal(params[limit.param]), param=field)
        job = {
            "id": f"video_{uuid.uuid4().hex}",
            "object": "video",
            "model": model,
            "status": "queued",
            "progress": 0,
            "created_at": int(time.time()),
            "completed_at": None,
            "expires_at": None,
            "error": None,
            "prompt": body.prompt,
            "seconds": f"{(params['num_frames'] - 1) / params['fps']:g}",
            "size": f"{params['width']}x{params['height']}",
            "remixed_from_video_id": None,
        }
        try:
            made = await store.create(job, params, idempotency(request, model, params, body))
        except QueueFull:
            raise Overloaded(
                f"{store.max_unfinished} video jobs are queued or running, as many as this "
                "pipeline takes (spec.videos.maxUnfinishedJobs); retry later",
                retry_after=QUEUE_FULL_RETRY_SECONDS,
            ) from None
        except KeyReused as exc:
            raise Conflict(
                f"this Idempotency-Key made video {exc.video_id!r} from another request",
                param="Idempotency-Key",
            ) from None
        return public(job if made == job["id"] else await found(made))

    @router.get("/v1/videos/{video_id}", response_model=None)
    async def retrieve(video_id: str) -> dict[str, Any]:
        return public(await found(video_id))

    # HEAD beside GET, out of the schema: one operation id a path and method.
    @router.get("/v1/videos/{video_id}/content", response_model=None)
    @router.head("/v1/videos/{video_id}/content", response_model=None, include_in_schema=False)
    async def content(
        request: Request,
        video_id: str,
        variant: Literal["video", "thumbnail", "spritesheet"] = "video",
    ) -> Response:
        job = await found(video_id)
        if variant != "video":
            raise BadRequest(f"variant {shown(variant)} is not made; only video", param="variant")
        if job["status"] == "failed":
            raise Conflict(f"video {video_id} failed: it has no content")
        if job["status"] != "completed":
            raise Conflict(
                f"video {video_id} is {job['status']}: its content is there once completed"
            )
        length = await store.content_length(video_id)
        expired = VideoNotFound(f"video {video_id}'s content has expired", param="video_id")
        if not length:
            raise expired
        opening = True  # the first part's failure is the client's 503; later, the status is out

        async def read(first: int, last: int) -> bytes:
            nonlocal opening
            answered, opening = not opening, False
            try:
                return await store.content_part(video_id, first, last)
            except StoreUnavailable:
                if not answered:
                    raise
                log.warning("video %s: the store went away mid-download", video_id)
                return b""

        try:
            return await ranged(length, read, "video/mp4", request, etag=video_id)
        except BodyGone:
            raise expired from None

    @router.get("/v1/videos", response_model=None)
    async def listing(
        limit: int = Query(default=20, ge=1, le=100),
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        # One more than asked: whether there are more. Expired jobs leave the index as
        # they are met, so a page may hold fewer than `limit` while more follow.
        ids = await store.page(after, limit + 1, newest_first=order == "desc")
        if ids is None:
            raise BadRequest(f"after: no video {shown(after)}", param="after")
        jobs = await store.jobs(ids)
        await store.forget([v for v, job in zip(ids, jobs, strict=True) if job is None])
        data = [public(job) for job in jobs if job is not None]
        page = data[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ids) > limit,
        }

    @router.post("/v1/videos/{video_id}/remix", response_model=None)
    async def remix(video_id: str) -> dict[str, Any]:
        """OpenAI's remix edits a finished video with a new prompt; no video pipeline here
        takes a video as input yet, so it is refused as such, not as an unknown URL."""
        await found(video_id)
        raise BadRequest(
            "remix is not supported: this pipeline makes videos from text only; create a "
            "new video with the changed prompt",
            param="video_id",
        )

    @router.delete("/v1/videos/{video_id}", response_model=None)
    async def delete(video_id: str) -> dict[str, Any]:
        """The job goes at once; a running one is also stopped, at the denoiser's next
        step, by the replica running it."""
        job = await found(video_id)
        if job["status"] in UNFINISHED:
            await store.cancel(video_id, runner.ttl_seconds)
        else:
            await store.delete(video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    return router
