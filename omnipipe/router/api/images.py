"""/v1/images/generations: OpenAI's image API on a text-to-image stage graph."""

from __future__ import annotations

import logging
import random
import re
import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from omnipipe.router.api.common import check_model, parse_body, unless_disconnected
from omnipipe.router.errors import BadRequest
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


def images_router(orchestrator: Orchestrator, model_ids: set[str]) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/images/generations")
    async def generate(request: Request) -> dict[str, Any]:
        body = await parse_body(ImageGenerationRequest, request)
        check_model(body.model, model_ids)
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
        images = await unless_disconnected(request, orchestrator.run(params))
        return {"created": int(time.time()), "data": images}

    return router
