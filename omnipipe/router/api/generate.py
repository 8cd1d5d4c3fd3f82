"""/v1/omni/generate: every emitting stage's output as it is made, labelled with its
stage, as vLLM-Omni's AsyncOmni.generate() yields them. The Python API (omnipipe.client)
reads it; any HTTP client can. One JSON object a line:

  {"type": "part", "stage", "index", "key", "text"}    a piece of a long field, in order
  {"type": "output", "stage", "index", "modality", "data"}    the rest of one output
  {"type": "finished", "stage"}                          the stage is done with the request
  {"type": "error", "error": {"message", "type", "param", "code"}}    then the stream ends
  {"type": "done"}                                       every stage is done

Every line also carries the request's request_id: the client's, or one the router made
(omni-<32 hex>) when it sent none."""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnipipe.api import ResolvedPipeline
from omnipipe.api.pipeline_traits import SPEECH_FIELDS
from omnipipe.api.plain_text import shown
from omnipipe.api.spec import Role
from omnipipe.router.api.adapters import LoraRequest, lora_param, set_stage_lora
from omnipipe.router.api.chat import AudioOptions, ChatPlan, ChatRequest
from omnipipe.router.api.common import (
    after,
    bad_request,
    check_model,
    first_output,
    json_body,
    parse_body,
    stage_with_role,
)
from omnipipe.router.api.images import MAX_IMAGES, ImageGenerationRequest, family_image_params
from omnipipe.router.api.messages import MESSAGE_SCHEMA
from omnipipe.router.api.speech import (
    MAX_NEW_TOKENS,
    MAX_SPOKEN_CHARS,
    SpeechRequest,
    speech_params,
)
from omnipipe.router.errors import BadRequest, OpenAIError
from omnipipe.router.orchestrator import Orchestrator
from omnipipe.router.outputs import Output, OutputPart, StageDone
from omnipipe.router.voice_store import VoiceStore

log = logging.getLogger(__name__)
# The speech fields a text-to-speech graph's generate request may add (/v1/audio/speech's).
SPEECH_EXTRA = SPEECH_FIELDS | {"speed"}
# An image request's fields that /v1/omni/generate shares with /v1/images/generations.
IMAGE_FIELDS = ("n", "size", "negative_prompt", "seed", "num_inference_steps", "guidance_scale")
# The request's fields that a text-to-speech graph has no use for: refused when set,
# never dropped unsaid.
NOT_SPOKEN = frozenset(
    {
        "messages",
        "temperature",
        "top_p",
        "mm_processor_kwargs",
        "n",
        "size",
        "negative_prompt",
        "num_inference_steps",
        "guidance_scale",
        "lora",
    }
)
Modality = Literal["text", "audio", "image"]


class GenerateRequest(BaseModel):
    """A prompt (or chat messages) and what to make of it. Lenient: unknown fields from
    newer clients are accepted and logged."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    prompt: str | None = Field(default=None, min_length=1, max_length=32_000)
    messages: list[dict[str, Any]] | None = Field(
        default=None, min_length=1, max_length=256, json_schema_extra={"items": MESSAGE_SCHEMA}
    )
    request_id: str | None = Field(default=None, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    output_modalities: list[Modality] | None = Field(default=None, min_length=1, max_length=3)
    sampling_params_list: list[dict[str, Any] | None] | dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # as in chat: use_audio_in_video, fps
    # AR stages
    max_tokens: int | None = Field(default=None, ge=1, le=65536)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    voice: str | None = Field(default=None, max_length=64)
    # Diffusion stages
    n: int = Field(default=1, ge=1, le=MAX_IMAGES)
    size: str = "1024x1024"
    negative_prompt: str | None = Field(default=None, max_length=32_000)
    num_inference_steps: int = Field(default=50, ge=1, le=200)
    guidance_scale: float = Field(default=4.0, ge=0, le=50)
    lora: LoraRequest | None = None


def modality_of(data: dict[str, Any]) -> Modality:
    if "b64_json" in data:
        return "image"
    return "audio" if "audio" in data else "text"


def _plan(
    pipeline: ResolvedPipeline, orchestrator: Orchestrator, body: GenerateRequest
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Stage params and emitters, as the OpenAI endpoint for this graph would make them."""
    wanted = set(body.output_modalities or [])
    if stage_with_role(pipeline, Role.THINKER) is not None:
        if "image" in wanted:
            raise BadRequest(
                f"model {shown(body.model)} ({pipeline.pipeline}) makes no images",
                param="output_modalities",
            )
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give either prompt or messages", param="prompt")
        chat = ChatRequest(
            model=body.model,
            messages=body.messages or [{"role": "user", "content": body.prompt}],
            stream=True,
            modalities=sorted(wanted) or ["text"],
            audio=AudioOptions(voice=body.voice, format="pcm16"),
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            sampling_params_list=body.sampling_params_list,
            mm_processor_kwargs=body.mm_processor_kwargs,
            lora=body.lora,
        )
        plan = ChatPlan(pipeline, chat)
        set_stage_lora(plan.params, orchestrator.serving_pipeline(), body.model, body.lora)
        return plan.params, plan.emitters
    if wanted - {"image"}:
        raise BadRequest(
            f"model {shown(body.model)} ({pipeline.pipeline}) makes images only",
            param="output_modalities",
        )
    if body.prompt is None:
        raise BadRequest(f"model {shown(body.model)} needs a text prompt", param="prompt")
    if body.sampling_params_list is not None:
        raise BadRequest(
            "sampling_params_list applies to AR stages; this graph has none",
            param="sampling_params_list",
        )
    # The fields the client set, as the image API's request: a family's extensions see
    # those alone, and give their model's defaults for the rest (as on the image API).
    image_body = ImageGenerationRequest(
        model=body.model,
        prompt=body.prompt,
        **{k: getattr(body, k) for k in IMAGE_FIELDS if k in body.model_fields_set},
    )
    params = family_image_params(pipeline, image_body, body.model_extra)
    if (lora := lora_param(orchestrator.serving_pipeline(), body.model, body.lora)) is not None:
        params["lora"] = lora
    return {stage: params for stage in orchestrator.stages}, set(orchestrator.outputs)


def speech_request(pipeline: ResolvedPipeline, body: GenerateRequest) -> SpeechRequest:
    """A text-to-speech graph's request: the prompt read aloud, as /v1/audio/speech would
    with raw PCM; the speech fields a TTS model takes (language, instructions, ref_audio,
    ...) come as the client's other fields, and max_tokens caps the talker's codes."""
    if "image" in (body.output_modalities or []) or "text" in (body.output_modalities or []):
        raise BadRequest(
            f"model {shown(body.model)} ({pipeline.pipeline}) makes audio only",
            param="output_modalities",
        )
    if body.prompt is None:
        raise BadRequest(
            f"model {shown(body.model)} reads a text prompt aloud: give prompt", param="prompt"
        )
    if refused := sorted(NOT_SPOKEN & body.model_fields_set):
        name = refused[0]
        raise BadRequest(
            f"model {shown(body.model)} ({pipeline.pipeline}) reads its prompt aloud and "
            f"takes no {name}",
            param=name,
        )
    if body.max_tokens is not None and body.max_tokens > MAX_NEW_TOKENS:
        raise BadRequest(
            f"max_tokens: at most {MAX_NEW_TOKENS} codes for speech, not {body.max_tokens}",
            param="max_tokens",
        )
    if len(body.prompt) > MAX_SPOKEN_CHARS:
        raise BadRequest(
            f"prompt: at most {MAX_SPOKEN_CHARS} characters are read aloud in one request",
            param="prompt",
        )
    extra = {k: v for k, v in (body.model_extra or {}).items() if k in SPEECH_EXTRA}
    return SpeechRequest.model_validate(
        {
            **extra,
            "model": body.model,
            "input": body.prompt,
            "voice": body.voice,
            "seed": body.seed,
            "max_new_tokens": body.max_tokens,
            "sampling_params_list": body.sampling_params_list,
            "response_format": "pcm",
        },
        strict=True,
    )


def _line(request_id: str, event: dict[str, Any]) -> bytes:
    return json.dumps({**event, "request_id": request_id}).encode() + b"\n"


async def _lines(
    request_id: str,
    first: Output | OutputPart | StageDone | None,
    rest: AsyncGenerator[Output | OutputPart | StageDone],
) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(rest):
        try:
            async for item in after(first, rest):
                if isinstance(item, OutputPart):
                    event: dict[str, Any] = {
                        "type": "part",
                        "stage": item.stage,
                        "index": item.index,
                        "key": item.key,
                        "text": item.text,
                    }
                elif isinstance(item, StageDone):
                    event = {"type": "finished", "stage": item.stage}
                elif item.data.get("audio") == "":
                    continue  # code2wav's last piece, empty: it counts codes for speech
                else:
                    event = {
                        "type": "output",
                        "stage": item.stage,
                        "index": item.index,
                        "modality": modality_of(item.data),
                        "data": item.data,
                    }
                yield _line(request_id, event)
        except OpenAIError as exc:
            # The status line is gone: the error is the stream's last line.
            log.warning("generate stream %s ended by an error: %s", request_id, exc.message)
            yield _line(request_id, {"type": "error", "error": exc.body()})
            return
    yield _line(request_id, {"type": "done"})


def generate_router(
    pipeline: ResolvedPipeline,
    orchestrator: Orchestrator,
    model_ids: Callable[[], set[str]],
    voices: VoiceStore | None = None,
) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/omni/generate", response_model=None, openapi_extra=json_body(GenerateRequest))
    async def generate(request: Request) -> StreamingResponse:
        body = await parse_body(GenerateRequest, request)
        check_model(body.model, model_ids())
        try:
            # A text-to-speech graph: no thinker to chat with, no denoiser to draw.
            if not {Role.THINKER, Role.DENOISER} & {s.role for s in pipeline.stages}:
                speech = speech_request(pipeline, body)
                params, emitters = await speech_params(pipeline, orchestrator, speech, voices)
            else:
                params, emitters = _plan(pipeline, orchestrator, body)
        except ValidationError as exc:  # an endpoint's own request, built from this one
            raise bad_request(exc, body.model_dump(mode="json")) from None
        outputs = orchestrator.stream_stages(params, emitters)
        # The first item before the status line: a request the stages refuse keeps its 4xx.
        first = await first_output(outputs)
        request_id = body.request_id or f"omni-{uuid.uuid4().hex}"
        return StreamingResponse(
            _lines(request_id, first, outputs), media_type="application/x-ndjson"
        )

    return router
