"""/v1/chat/completions on a thinker (-> talker -> code2wav) stage graph: text, and
audio when asked for, as one response or as OpenAI chat.completion.chunk SSE."""

from __future__ import annotations

import base64
import contextlib
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from omnipipe.api import ResolvedPipeline
from omnipipe.api.families import RequestExtensions
from omnipipe.api.plain_text import shown
from omnipipe.api.spec import Role
from omnipipe.router.api.adapters import LoraRequest, set_stage_lora
from omnipipe.router.api.audio import pcm_of, wav_bytes
from omnipipe.router.api.common import (
    after,
    chat_makes_images,
    check_model,
    family_requests,
    first_output,
    json_body,
    parse_body,
    request_fields,
    sampling_overrides,
    sse_event,
    stage_with_role,
    unless_disconnected,
    with_family_checks,
)
from omnipipe.router.api.images import parse_size
from omnipipe.router.api.inputs import check_processor_kwargs, check_sampling, check_token_range
from omnipipe.router.api.messages import MESSAGE_SCHEMA, thinker_messages
from omnipipe.router.errors import BadRequest, OpenAIError
from omnipipe.router.orchestrator import Orchestrator
from omnipipe.router.outputs import Output

AUDIO_EXPIRES_SECONDS = 3600


class AudioOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    voice: str | None = None
    format: Literal["wav", "pcm16"] = "wav"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatRequest(BaseModel):
    """Lenient: unknown fields from newer clients are accepted and logged."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    messages: list[dict[str, Any]] = Field(
        min_length=1, max_length=256, json_schema_extra={"items": MESSAGE_SCHEMA}
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio", "image"]] = ["text"]
    """"image" (BAGEL): the answer text, then an image made over the conversation and
    the answer; see omnipipe/families/bagel/requests.py for the image's request extensions."""
    audio: AudioOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=65536)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=65536)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    n: int = Field(default=1, ge=1, le=1)
    sampling_params_list: list[dict[str, Any] | None] | dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="passed to the thinker's processor: use_audio_in_video (bool), fps",
    )
    lora: LoraRequest | None = None
    """A LoRA adapter of the thinker ({"name"}); naming the adapter as the model does too."""


class ChatPlan:
    """Which stages run and with what: the thinker alone for text, the whole chain for
    audio."""

    def __init__(self, pipeline: ResolvedPipeline, body: ChatRequest) -> None:
        thinker = stage_with_role(pipeline, Role.THINKER)
        if thinker is None:
            raise BadRequest(
                f"model {shown(body.model)} ({pipeline.pipeline}) does not serve chat completions",
                param="model",
            )
        self.thinker = thinker
        self.want_audio = "audio" in body.modalities
        self.want_image = "image" in body.modalities
        extensions = family_requests(pipeline)
        makes_images = chat_makes_images(extensions)
        if self.want_image and not makes_images:
            raise BadRequest(
                f"model {shown(body.model)} ({pipeline.pipeline}) makes no images in chat",
                param="modalities",
            )
        self.audio = body.audio or AudioOptions()
        code2wav = stage_with_role(pipeline, Role.CODE2WAV)
        if self.want_audio and code2wav is None:
            raise BadRequest(
                f"model {shown(body.model)} has no audio output stage", param="modalities"
            )
        if body.stream and self.want_audio and self.audio.format != "pcm16":
            raise BadRequest(
                "streamed audio is sent as pcm16 chunks: set audio.format to pcm16",
                param="audio.format",
            )
        self.emitters = {thinker}
        if self.want_audio and code2wav is not None:
            self.emitters.add(code2wav)
        overrides = sampling_overrides(pipeline, body.sampling_params_list)
        text_sampling = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_tokens": body.max_completion_tokens or body.max_tokens,
            "seed": body.seed,
        }
        check_sampling(text_sampling)
        seed = body.seed if body.seed is not None else random.randrange(2**31)
        common = {"voice": self.audio.voice, "seed": seed}
        self.params: dict[str, dict[str, Any]] = {
            s.name: {**common, "sampling": overrides.get(s.name)} for s in pipeline.stages
        }
        self.params[thinker] = {
            **common,
            "messages": thinker_messages(body.messages),
            "mm_processor_kwargs": check_processor_kwargs(body.mm_processor_kwargs),
            "audio": self.want_audio,
            "sampling": {
                **{k: v for k, v in text_sampling.items() if v is not None},
                **overrides.get(thinker, {}),
            },
        }
        check_token_range(
            {**pipeline.stage(thinker).sampling, **self.params[thinker]["sampling"]},
            f"sampling_params_list.{thinker}",
            "min_tokens" in overrides.get(thinker, {})
            or "max_tokens" in overrides.get(thinker, {}),
            "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        )
        if makes_images:
            assert extensions is not None
            self._image(pipeline, body, seed, extensions)

    def _image(
        self,
        pipeline: ResolvedPipeline,
        body: ChatRequest,
        seed: int,
        extensions: RequestExtensions,
    ) -> None:
        """For a family that makes images in chat (BAGEL): the thinker answers when text
        is asked for; with an image, the decode stage emits it and every stage gets the
        image's parameters."""
        self.params[self.thinker]["text"] = "text" in body.modalities
        self.params[self.thinker]["image"] = self.want_image
        if not self.want_image:
            return
        decode = stage_with_role(pipeline, Role.VAE_DECODER)
        if decode is None:
            raise BadRequest(
                f"model {shown(body.model)} has no image output stage", param="modalities"
            )
        self.emitters.add(decode)
        fields = request_fields(body)
        image = {
            **with_family_checks(lambda: extensions.chat_image_params(fields, parse_size)),
            "seed": seed,
            "n": 1,
        }
        for params in self.params.values():
            params.update(image)


class ChatResult:
    def __init__(self) -> None:
        self.text = ""
        self.pcm = bytearray()
        self.sample_rate = 0
        self.finish_reason = "stop"
        self.usage: dict[str, int] = {}
        self.images: list[dict[str, Any]] = []

    def add(self, output: Output) -> None:
        data = output.data
        if "b64_json" in data:
            self.images.append(image_content(str(data["b64_json"])))
            return
        if "text" in data:
            self.text += str(data["text"])
        if "audio" in data:
            self.pcm += pcm_of(data)
            self.sample_rate = int(data["sample_rate"])
        if "finish_reason" in data:
            self.finish_reason = str(data["finish_reason"])
            # A stage that counts no tokens reports none: 0, not a broken stream.
            prompt = int(data.get("prompt_tokens", 0))
            completion = int(data.get("completion_tokens", 0))
            self.usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }


def image_content(b64_png: str) -> dict[str, Any]:
    """An image in a chat message or delta, as an image_url content part."""
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64_png}"}}


def chat_router(
    pipeline: ResolvedPipeline, orchestrator: Orchestrator, model_ids: Callable[[], set[str]]
) -> APIRouter:
    router = APIRouter()

    async def complete(
        request: Request, body: ChatRequest, plan: ChatPlan, outputs: AsyncGenerator[Output]
    ) -> JSONResponse:
        result = ChatResult()

        async def collect() -> None:
            async for output in outputs:
                result.add(output)

        await unless_disconnected(request, collect())
        created = int(time.time())
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if result.images:
            message["images"] = result.images
        if plan.want_audio:
            audio = (
                wav_bytes(bytes(result.pcm), result.sample_rate or 24_000)
                if plan.audio.format == "wav"
                else bytes(result.pcm)
            )
            message["audio"] = {
                "id": f"audio_{uuid.uuid4().hex}",
                "data": base64.b64encode(audio).decode(),
                "expires_at": created + AUDIO_EXPIRES_SECONDS,
                "transcript": result.text,
            }
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": created,
                "model": body.model,
                "choices": [
                    {"index": 0, "message": message, "finish_reason": result.finish_reason}
                ],
                "usage": result.usage,
            }
        )

    async def stream(
        body: ChatRequest, plan: ChatPlan, first: Output | None, outputs: AsyncGenerator[Output]
    ) -> AsyncIterator[bytes]:
        chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        audio_id = f"audio_{uuid.uuid4().hex}"
        result = ChatResult()

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return sse_event(
                {
                    "id": chunk_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": body.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }
            )

        yield chunk({"role": "assistant", "content": ""})
        # Text, then image: an image that arrives before the answer's end waits for it.
        held: list[Output] = []
        answered = not plan.want_image
        try:
            async for output in after(first, outputs):
                data = output.data
                if "b64_json" in data and not answered:
                    held.append(output)
                    continue
                result.add(output)
                if "b64_json" in data:
                    yield chunk({"images": result.images[-1:]})
                if data.get("text"):
                    yield chunk({"content": data["text"]})
                if "finish_reason" in data and output.stage == plan.thinker:
                    answered = True
                    for image in held:
                        result.add(image)
                        yield chunk({"images": result.images[-1:]})
                    held = []
                if data.get("audio"):  # the last piece may be empty (it counts codes)
                    yield chunk({"audio": {"id": audio_id, "data": data["audio"]}})
        except OpenAIError as exc:
            # The status line is gone; the error goes in the stream, as OpenAI does.
            yield sse_event({"error": exc.body()})
            yield b"data: [DONE]\n\n"
            return
        for image in held:  # text-less requests: the image is all there is
            result.add(image)
            yield chunk({"images": result.images[-1:]})
        finish: dict[str, Any] = {}
        if plan.want_audio:
            finish["audio"] = {"id": audio_id, "transcript": result.text}
        yield chunk(finish, result.finish_reason)
        if body.stream_options and body.stream_options.include_usage:
            yield sse_event(
                {
                    "id": chunk_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": body.model,
                    "choices": [],
                    "usage": result.usage,
                }
            )
        yield b"data: [DONE]\n\n"

    @router.post("/v1/chat/completions", response_model=None, openapi_extra=json_body(ChatRequest))
    async def chat(request: Request) -> JSONResponse | StreamingResponse:
        body = await parse_body(ChatRequest, request)
        check_model(body.model, model_ids())
        plan = ChatPlan(pipeline, body)
        set_stage_lora(plan.params, orchestrator.serving_pipeline(), body.model, body.lora)
        outputs = orchestrator.stream(plan.params, plan.emitters)
        if not body.stream:
            async with contextlib.aclosing(outputs):
                return await complete(request, body, plan, outputs)
        first = await first_output(outputs)

        async def body_stream() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(outputs):
                async for part in stream(body, plan, first, outputs):
                    yield part

        return StreamingResponse(body_stream(), media_type="text/event-stream")

    return router
