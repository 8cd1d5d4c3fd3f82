"""/v1/images/generations: OpenAI's image API on a text-to-image stage graph."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from omnipipe.api import ResolvedPipeline
from omnipipe.api.pipeline_traits import edits
from omnipipe.api.plain_text import shown
from omnipipe.api.spec import Role
from omnipipe.api.wire import IMAGE_TOKENS, OUTPUT_TOKENS, TEXT_TOKENS
from omnipipe.router.api.adapters import LoraRequest, lora_param
from omnipipe.router.api.common import (
    DEFAULT_CFG_ABOVE,
    after,
    cfg_guidance_above,
    check_model,
    family_requests,
    first_output,
    json_body,
    parse_body,
    request_fields,
    stage_with_role,
    unless_disconnected,
    with_family_checks,
)
from omnipipe.router.errors import BadRequest, OpenAIError
from omnipipe.router.orchestrator import Orchestrator
from omnipipe.router.outputs import Output, OutputPart

log = logging.getLogger(__name__)
# Bounded digits: int() of a side with thousands of digits is slow, then refused.
SIZE = re.compile(r"([0-9]{1,6})x([0-9]{1,6})")  # ASCII: \d takes any script's digits
SIZE_MULTIPLE = 16
MAX_SIDE = 2048
MAX_IMAGES = 10  # OpenAI's n
ImageFormat = Literal["png", "jpeg", "webp"]
Background = Literal["auto", "opaque", "transparent"]


class ImageGenerationRequest(BaseModel):
    """Lenient: unknown fields from newer clients are accepted and logged."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    prompt: str = Field(min_length=1, max_length=32_000)
    n: int = Field(default=1, ge=1, le=MAX_IMAGES)
    size: str = Field(default="1024x1024", examples=["1024x1024"])
    """WIDTHxHEIGHT, each side a multiple of 16 from 16 to 2048."""
    response_format: str = "b64_json"
    output_format: ImageFormat = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)
    """0-100, for jpeg and webp: 100 (the default) compresses least; webp at 100 is
    lossless."""
    background: Background = "auto"
    """auto or opaque; these models draw no transparency, so transparent is refused."""
    negative_prompt: str | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    num_inference_steps: int = Field(default=50, ge=1, le=200)
    guidance_scale: float = Field(default=4.0, ge=0, le=50)
    lora: LoraRequest | None = None
    """A LoRA adapter of the pipeline and its scale; naming the adapter as the model
    applies it at its configured scale."""


def parse_size(size: str) -> tuple[int, int]:
    m = SIZE.fullmatch(size)
    if not m:
        raise BadRequest(f"size must look like 1024x1024, got {shown(size)}", param="size")
    width, height = int(m[1]), int(m[2])
    for side in (width, height):
        if not SIZE_MULTIPLE <= side <= MAX_SIDE or side % SIZE_MULTIPLE:
            raise BadRequest(
                f"size sides must be multiples of {SIZE_MULTIPLE} between "
                f"{SIZE_MULTIPLE} and {MAX_SIDE}, got {shown(size)}",
                param="size",
            )
    return width, height


def image_params(
    body: ImageGenerationRequest,
    size: tuple[int, int] | None = None,
    cfg_above: float = DEFAULT_CFG_ABOVE,
) -> dict[str, object]:
    """What every stage of a text-to-image graph is given for this request; its model's
    CFG runs at a guidance above `cfg_above` (cfg_guidance_above)."""
    width, height = size or parse_size(body.size)
    if body.negative_prompt and body.guidance_scale <= cfg_above:
        # No CFG at this guidance: the negative prompt would be silently ignored.
        raise BadRequest(
            f"guidance_scale: with a negative_prompt it must be above {cfg_above:g} (true CFG), "
            f"got {body.guidance_scale:g}",
            param="guidance_scale",
        )
    check_output_format(body)
    params: dict[str, object] = {
        "prompt": body.prompt,
        "negative_prompt": body.negative_prompt,
        "n": body.n,
        "width": width,
        "height": height,
        "seed": body.seed if body.seed is not None else random.randrange(2**31),
        "num_inference_steps": body.num_inference_steps,
        "guidance_scale": body.guidance_scale,
        "output_format": body.output_format,
    }
    if body.output_compression is not None:
        params["output_compression"] = body.output_compression
    return params


def family_image_params(
    pipeline: ResolvedPipeline,
    body: ImageGenerationRequest,
    more: Mapping[str, Any] | None = None,
) -> dict[str, object]:
    """image_params with the family's part: its CFG threshold, then its defaults and
    refusals, read off what the client set (`body`'s set fields and extensions, and
    `more`: another endpoint's extensions)."""
    extensions = family_requests(pipeline)
    params = image_params(body, cfg_above=cfg_guidance_above(extensions))
    if extensions is not None:
        fields = {**request_fields(body), **(more or {})}
        params.update(with_family_checks(lambda: extensions.image_params(fields)))
    return params


def check_output_format(body: ImageGenerationRequest) -> None:
    if body.output_compression is not None and body.output_format == "png":
        raise BadRequest(
            "output_compression applies to jpeg and webp; png is lossless, so leave it out",
            param="output_compression",
        )
    if body.background == "transparent":
        raise BadRequest(
            "background: this pipeline draws opaque images; transparent is not supported "
            "(auto or opaque)",
            param="background",
        )


def response_fields(params: dict[str, object]) -> dict[str, object]:
    """What the response says of its images besides them, as OpenAI's does."""
    return {
        "background": "opaque",
        "output_format": params["output_format"],
        "size": f"{params['width']}x{params['height']}",
    }


def openai_usage(counted: Mapping[str, int]) -> dict[str, object]:
    """The stages' counts (api/wire.py USAGE_KEYS) as OpenAI's image API says usage."""
    text, images = counted.get(TEXT_TOKENS, 0), counted.get(IMAGE_TOKENS, 0)
    output = counted.get(OUTPUT_TOKENS, 0)
    return {
        "input_tokens": text + images,
        "input_tokens_details": {"image_tokens": images, "text_tokens": text},
        "output_tokens": output,
        "output_tokens_details": {"image_tokens": output, "text_tokens": 0},
        "total_tokens": text + images + output,
    }


def with_usage(fields: dict[str, object], counted: Mapping[str, int]) -> dict[str, object]:
    """`fields` and, where the stages counted any, their usage."""
    return {**fields, "usage": openai_usage(counted)} if counted else fields


async def image_json(
    created: int,
    first: Output | OutputPart,
    rest: AsyncGenerator[Output | OutputPart],
    trailer: Callable[[], dict[str, object]],
) -> AsyncIterator[bytes]:
    """The response, {"created": ..., "data": [...], TRAILER}, written as the images
    arrive, each image's base64 piece by piece: the router never holds a whole image.
    The trailer is asked for once the last image is out (the stages' usage is known
    only then)."""
    yield b'{"created": %d, "data": [' % created
    count, open_key = 0, None

    async with contextlib.aclosing(rest):
        try:
            async for item in after(first, rest):
                if isinstance(item, OutputPart):
                    key = json.dumps(item.key).encode()
                    if open_key is None:
                        yield (b", {" if count else b"{") + key + b': "'
                    elif open_key != item.key:
                        yield b'", ' + key + b': "'
                    open_key = item.key
                    # JSON-escaping is per character, so escaped pieces join correctly.
                    yield json.dumps(item.text)[1:-1].encode()
                    continue
                fields = json.dumps(item.data)[1:-1].encode()
                if open_key is None:
                    yield (b", {" if count else b"{") + fields + b"}"
                else:
                    yield b'"' + (b", " + fields if fields else b"") + b"}"
                open_key, count = None, count + 1
        except OpenAIError as exc:
            # The status line is gone: cut the body short, so the client sees a failure.
            log.warning("image response cut short: %s", exc.message)
            raise
    ending = trailer().items()
    yield b"]" + b"".join(b", " + json.dumps({k: v})[1:-1].encode() for k, v in ending)
    yield b"}"


async def respond_with_images(
    request: Request,
    orchestrator: Orchestrator,
    params: dict[str, dict[str, object]],
    fields: dict[str, object],
) -> Response:
    """Run every stage with its params; answer with the output stages' images, then
    `fields` (response_fields) and the usage that the stages counted."""
    counted: Counter[str] = Counter()
    outputs = orchestrator.stream_parts(params, set(orchestrator.outputs), counted)
    # Wait for the first piece before the status line, so errors keep their status.
    first = await unless_disconnected(request, first_output(outputs))
    created = int(time.time())
    if first is None:
        return JSONResponse({"created": created, "data": [], **with_usage(fields, counted)})
    return StreamingResponse(
        image_json(created, first, outputs, lambda: with_usage(fields, counted)),
        media_type="application/json",
    )


def edits_images(orchestrator: Orchestrator) -> bool:
    """An image-edit graph: it has a stage that encodes the input image, or its type says
    it edits (a whole pipeline in one stage)."""
    pipeline = orchestrator.pipeline
    return stage_with_role(pipeline, Role.VAE_ENCODER) is not None or edits(pipeline.pipeline)


def images_router(orchestrator: Orchestrator, model_ids: Callable[[], set[str]]) -> APIRouter:
    router = APIRouter()

    @router.post(
        "/v1/images/generations",
        response_model=None,
        openapi_extra=json_body(ImageGenerationRequest),
    )
    async def generate(request: Request) -> Response:
        body = await parse_body(ImageGenerationRequest, request)
        check_model(body.model, model_ids())
        if body.response_format != "b64_json":
            raise BadRequest("only response_format=b64_json is supported", param="response_format")
        if edits_images(orchestrator):
            raise BadRequest("this pipeline edits images: send the image to POST /v1/images/edits")
        pipeline = orchestrator.pipeline
        if stage_with_role(pipeline, Role.DENOISER) is None:
            raise BadRequest(
                f"model {shown(body.model)} ({pipeline.pipeline}) makes no images", param="model"
            )
        params = family_image_params(pipeline, body)
        lora = lora_param(orchestrator.serving_pipeline(), body.model, body.lora)
        if lora is not None:
            params["lora"] = lora
        return await respond_with_images(
            request,
            orchestrator,
            {stage: params for stage in orchestrator.stages},
            response_fields(params),
        )

    return router
