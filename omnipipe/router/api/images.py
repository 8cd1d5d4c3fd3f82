"""/v1/images/generations: OpenAI's image API on a text-to-image stage graph."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnipipe.router.errors import BadRequest, ModelNotFound
from omnipipe.router.orchestrator import Orchestrator

log = logging.getLogger(__name__)
SIZE = re.compile(r"^(\d+)x(\d+)$")
SIZE_MULTIPLE = 16
MAX_SIDE = 2048


class ImageGenerationRequest(BaseModel):
    """Lenient: unknown fields from newer clients are accepted and logged."""

    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str = Field(min_length=1, max_length=32_000)
    n: int = Field(default=1, ge=1, le=4)
    size: str = "1024x1024"
    response_format: str = "b64_json"
    negative_prompt: str | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    num_inference_steps: int = Field(default=50, ge=1, le=200)
    guidance_scale: float = Field(default=4.0, ge=0, le=50)


def parse_size(size: str) -> tuple[int, int]:
    m = SIZE.match(size)
    if not m:
        raise BadRequest(f"size must look like 1024x1024, got {size!r}", param="size")
    width, height = int(m[1]), int(m[2])
    for side in (width, height):
        if not SIZE_MULTIPLE <= side <= MAX_SIDE or side % SIZE_MULTIPLE:
            raise BadRequest(
                f"size sides must be multiples of {SIZE_MULTIPLE} between "
                f"{SIZE_MULTIPLE} and {MAX_SIDE}, got {size!r}",
                param="size",
            )
    return width, height


async def _until_disconnected(request: Request) -> None:
    # Starlette offers no disconnect event for a plain endpoint; polling is the way.
    while not await request.is_disconnected():  # noqa: ASYNC110
        await asyncio.sleep(0.2)


def images_router(orchestrator: Orchestrator, model_ids: set[str]) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/images/generations")
    async def generate(request: Request) -> dict[str, Any]:
        try:
            body = ImageGenerationRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise BadRequest(
                f"{param}: {err['msg']}" if param else err["msg"], param=param
            ) from None
        if body.model_extra:
            log.info("ignoring unknown image request fields: %s", sorted(body.model_extra))
        if body.model not in model_ids:
            raise ModelNotFound(
                f"model {body.model!r} does not exist", param="model", code="model_not_found"
            )
        if body.response_format != "b64_json":
            raise BadRequest("only response_format=b64_json is supported", param="response_format")
        width, height = parse_size(body.size)
        params = {
            "prompt": body.prompt,
            "negative_prompt": body.negative_prompt,
            "n": body.n,
            "width": width,
            "height": height,
            "seed": body.seed if body.seed is not None else random.randrange(2**31),
            "num_inference_steps": body.num_inference_steps,
            "guidance_scale": body.guidance_scale,
        }
        work = asyncio.create_task(orchestrator.run(params))
        watch = asyncio.create_task(_until_disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():
            log.info("client went away: cancelling image request")
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise BadRequest("client disconnected")
        images = work.result()
        return {"created": int(time.time()), "data": images}

    return router
