"""A pipeline's answer at the endpoints of other pipelines: a 400 naming its own. A video
pipeline's videos are jobs (/v1/videos): they queue, a replica runs a bounded number at
once, each has the video checks and outlives the client that asked. Run through
/v1/omni/generate or /v1/images/generations instead, a 38-byte request would hold the
denoiser for minutes with the image endpoint's defaults, past any job limit, and after
its client left. An audio pipeline (router/api/audio_generate.py) answers the same way."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn

from fastapi import APIRouter, Request

from omnipipe.api import ResolvedPipeline
from omnipipe.router.errors import BadRequest

SYNCHRONOUS = (
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/chat/completions",
    "/v1/audio/speech",
    "/v1/omni/generate",
)


def elsewhere_router(paths: Sequence[str], refusal: Callable[[str], str]) -> APIRouter:
    """A 400 at each of `paths` (POST), saying refusal(the path asked) and naming the
    model; not in the OpenAPI document, which lists what the pipeline serves."""
    router = APIRouter()

    async def elsewhere(request: Request) -> NoReturn:
        raise BadRequest(refusal(request.url.path), param="model")

    for path in paths:
        router.add_api_route(
            path, elsewhere, methods=["POST"], include_in_schema=False, response_model=None
        )
    return router


def video_only_router(pipeline: ResolvedPipeline) -> APIRouter:
    """A 400 at each synchronous endpoint, naming the one that makes this pipeline's
    videos."""
    return elsewhere_router(
        SYNCHRONOUS,
        lambda path: (
            f"pipeline {pipeline.name} makes videos, which are jobs: create one with POST "
            f"/v1/videos, then poll GET /v1/videos/{{id}} and fetch /v1/videos/{{id}}/content; "
            f"{path} serves image, text and speech pipelines"
        ),
    )
