"""A video pipeline's answer at the endpoints that run a request inside one HTTP call. Its
videos are jobs (/v1/videos): they queue, a replica runs a bounded number at once, each
has the video checks and outlives the client that asked. Run through /v1/omni/generate or
/v1/images/generations instead, a 38-byte request would hold the denoiser for minutes with
the image endpoint's defaults, past any job limit, and after its client left."""

from __future__ import annotations

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


def video_only_router(pipeline: ResolvedPipeline) -> APIRouter:
    """A 400 at each synchronous endpoint, naming the one that makes this pipeline's
    videos; not in the OpenAPI document, which lists what the pipeline serves."""
    router = APIRouter()

    async def elsewhere(request: Request) -> NoReturn:
        raise BadRequest(
            f"pipeline {pipeline.name} makes videos, which are jobs: create one with POST "
            f"/v1/videos, then poll GET /v1/videos/{{id}} and fetch /v1/videos/{{id}}/content; "
            f"{request.url.path} serves image, text and speech pipelines",
            param="model",
        )

    for path in SYNCHRONOUS:
        router.add_api_route(
            path, elsewhere, methods=["POST"], include_in_schema=False, response_model=None
        )
    return router
