"""/v1/audio/generate: audio (music, sound effects) from a text description, vLLM-Omni's
endpoint, on a pipeline whose type makes audio (PipelineType.makes_audio). The type's
request extensions (audio_params) turn the body's settings into its stages' parameters,
so each audio model brings its own fields and bounds; the answer is the audio itself, in
the requested format, as /v1/audio/speech answers."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncGenerator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from omnipipe.api import ResolvedPipeline
from omnipipe.router.api.audio import pcm_of, wav_bytes
from omnipipe.router.api.common import (
    check_model,
    family_requests,
    json_body,
    parse_body,
    request_fields,
    unless_disconnected,
    with_family_checks,
)
from omnipipe.router.api.speech import MEDIA_TYPES
from omnipipe.router.api.video_only import SYNCHRONOUS, elsewhere_router
from omnipipe.router.errors import BadRequest, InternalError
from omnipipe.router.orchestrator import Orchestrator
from omnipipe.router.outputs import Output

MAX_PROMPT_CHARS = 32_000


class AudioGenerateRequest(BaseModel):
    """vLLM-Omni's request. Lenient: unknown fields from newer clients are accepted and
    logged. The generation settings' bounds are the pipeline type's (audio_params); what
    the client leaves out keeps the model's defaults."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    input: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    """What the audio should sound like."""
    model: str | None = None
    """The pipeline's model id; the pipeline's own when left out."""
    response_format: Literal["wav", "pcm", "flac", "mp3", "aac", "opus"] = "wav"
    """pcm: 16-bit little-endian mono at the X-Sample-Rate header's rate; opus in Ogg,
    aac in ADTS."""
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    """A time-stretch that keeps the pitch (FFmpeg's atempo)."""
    stream_format: Literal["audio", "sse"] = "audio"
    """audio only: the audio is made whole, so there are no pieces to send as events."""
    audio_length: float | None = None
    """Seconds of audio."""
    audio_start: float | None = None
    """Where in a longer piece the clip starts, in seconds, for models that place it."""
    negative_prompt: str | None = None
    guidance_scale: float | None = None
    num_inference_steps: int | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)


def audio_params(pipeline: ResolvedPipeline, body: AudioGenerateRequest) -> dict[str, Any]:
    """Every stage's parameters for the request: the type's reading of the settings, the
    prompt, the seed (drawn where the client chose none) and the format."""
    if not body.input.strip():
        raise BadRequest("input: describe the audio; it is blank", param="input")
    if body.stream_format == "sse":
        raise BadRequest(
            "stream_format: sse is not served here, the audio is made whole; send audio",
            param="stream_format",
        )
    extensions = family_requests(pipeline)
    read = getattr(extensions, "audio_params", None)
    if read is None:
        raise BadRequest(
            f"pipeline {pipeline.name} ({pipeline.pipeline}) names no audio settings",
            param="model",
        )
    params = with_family_checks(lambda: read(request_fields(body)))
    return {
        **params,
        "prompt": body.input,
        "seed": body.seed if body.seed is not None else random.randrange(2**31),
        "response_format": body.response_format,
        "speed": body.speed,
    }


async def collected(outputs: AsyncGenerator[Output]) -> tuple[bytes, int]:
    """The audio the output stages sent, joined, and its sample rate."""
    data, rate = bytearray(), None
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            data.extend(pcm_of(output.data))
            rate = int(output.data["sample_rate"])
    if rate is None:
        raise InternalError("the pipeline finished the request with no audio")
    return bytes(data), rate


def audio_generate_router(
    orchestrator: Orchestrator, model_ids: Callable[[], set[str]]
) -> APIRouter:
    router = APIRouter()

    @router.post(
        "/v1/audio/generate", response_model=None, openapi_extra=json_body(AudioGenerateRequest)
    )
    async def generate(request: Request) -> Response:
        body = await parse_body(AudioGenerateRequest, request)
        pipeline = orchestrator.pipeline
        check_model(body.model or pipeline.name, model_ids())
        params = audio_params(pipeline, body)
        outputs = orchestrator.stream(
            {stage: params for stage in orchestrator.stages}, set(orchestrator.outputs)
        )
        data, rate = await unless_disconnected(request, collected(outputs))
        headers = {"X-Sample-Rate": str(rate)}
        if body.response_format == "wav":
            return Response(wav_bytes(data, rate), media_type="audio/wav", headers=headers)
        if body.response_format == "pcm":
            headers["X-Sample-Format"] = "s16le"
        return Response(data, media_type=MEDIA_TYPES[body.response_format], headers=headers)

    return router


def audio_only_router(pipeline: ResolvedPipeline) -> APIRouter:
    """A 400 at the endpoints of image, text, speech and video pipelines, naming the one
    that makes this pipeline's audio."""
    return elsewhere_router(
        (*SYNCHRONOUS, "/v1/videos"),
        lambda path: (
            f"pipeline {pipeline.name} makes audio from a description: send it to POST "
            f"/v1/audio/generate; {path} serves other pipelines"
        ),
    )
