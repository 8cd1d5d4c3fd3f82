"""/v1/audio/speech: text to speech. Through an omni chain the thinker is teacher-forced
on the input text, so the talker speaks exactly that text in the chosen voice; a TTS
pipeline's talker (no thinker) reads the text itself."""

from __future__ import annotations

import base64
import contextlib
import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from omnipipe.api import ResolvedPipeline
from omnipipe.api.pipeline_traits import SPEECH_FIELDS, speech_fields
from omnipipe.api.plain_text import shown
from omnipipe.api.spec import Role
from omnipipe.router.api.adapters import set_stage_lora
from omnipipe.router.api.audio import pcm_of, wav_bytes
from omnipipe.router.api.common import (
    check_model,
    first_output,
    json_body,
    parse_body,
    sampling_overrides,
    sse_event,
    stage_with_role,
    unless_disconnected,
)
from omnipipe.router.api.inputs import check_token_range
from omnipipe.router.api.voices import NAME
from omnipipe.router.errors import BadRequest
from omnipipe.router.orchestrator import Orchestrator
from omnipipe.router.outputs import Output
from omnipipe.router.redis_store import StoreUnavailable
from omnipipe.router.voice_store import ClipRefused, VoiceStore

DEFAULT_SAMPLE_RATE = 24_000
MAX_SPOKEN_CHARS = 4096  # a request's text, as OpenAI's speech API takes it
# Codec frames a request may ask for: a talker's context at most (32k for the released
# Qwen-Omni talkers; at 50 codes a second that is Qwen2.5-Omni's 11 minutes).
MAX_NEW_TOKENS = 32_768
# A reference clip as a data URL: 10 MB of audio, base64.
MAX_REF_AUDIO_CHARS = 14_000_000
MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "flac": "audio/flac",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "pcm": "audio/pcm",
}


log = logging.getLogger(__name__)


class SpeechUsage:
    """OpenAI's speech usage, read off the outputs as they pass: the prompt tokens of the
    stage that reads the text (a thinker, or a TTS talker; an emitter under SSE) and the
    codes code2wav turned into audio."""

    def __init__(self) -> None:
        self.input_tokens = 0
        self.output_tokens = 0

    async def audio_of(self, outputs: AsyncGenerator[Output]) -> AsyncGenerator[Output]:
        """The outputs that carry audio; the counts they and the others carry kept."""
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                data = output.data
                self.input_tokens = int(data.get("prompt_tokens", self.input_tokens))
                self.output_tokens = int(data.get("codes", self.output_tokens))
                if data.get("audio"):
                    yield output

    def as_dict(self) -> dict[str, int]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "total_tokens": self.input_tokens + self.output_tokens,
        }


async def sse_events(pieces: AsyncIterator[bytes], usage: SpeechUsage) -> AsyncIterator[bytes]:
    """OpenAI's speech events: speech.audio.delta with each piece, then speech.audio.done
    with the usage."""
    async for piece in pieces:
        yield sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(piece).decode()})
    yield sse_event({"type": "speech.audio.done", "usage": usage.as_dict()})


def taken_fields(body: SpeechRequest) -> list[str]:
    """The optional fields the request set."""
    return sorted(name for name in SPEECH_FIELDS if getattr(body, name) is not None)


def refuse_fields_not_taken(body: SpeechRequest, pipeline_type: str) -> None:
    """A 400 naming the first optional field set that the pipeline type does not take."""
    taken = speech_fields(pipeline_type)
    for name in sorted(SPEECH_FIELDS - taken):
        if getattr(body, name) is not None:
            others = f" (it takes {', '.join(sorted(taken))})" if taken else ""
            raise BadRequest(
                f"model {shown(body.model)}, a {pipeline_type} pipeline, does not take "
                f"{name}{others}",
                param=name,
            )


class SpeechRequest(BaseModel):
    """Lenient: unknown fields from newer clients are accepted and logged."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    input: str = Field(min_length=1, max_length=MAX_SPOKEN_CHARS)
    voice: str | None = None
    response_format: Literal["wav", "mp3", "flac", "opus", "aac", "pcm"] = "wav"
    """pcm: 16-bit little-endian mono at the X-Sample-Rate header's rate (24 kHz); opus in
    Ogg, aac in ADTS."""
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    """A time-stretch that keeps the pitch (FFmpeg's atempo)."""
    stream_format: Literal["audio", "sse"] = "audio"
    """audio: the body is the audio, streamed as it is made (wav is sent whole: its header
    holds the length). sse: speech.audio.delta events with base64 audio, then
    speech.audio.done."""
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    max_new_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    """At most this many codes chosen by the talker (its sampling's max_tokens): a frame
    each, except that the one that ends the speech may make none."""
    # Taken only by the models whose pipeline type lists them (SPEECH_FIELDS).
    instructions: str | None = Field(default=None, max_length=4096)
    language: str | None = Field(default=None, max_length=64)
    task_type: Literal["CustomVoice", "VoiceDesign", "Base"] | None = None
    ref_audio: str | None = Field(default=None, max_length=MAX_REF_AUDIO_CHARS)
    ref_text: str | None = Field(default=None, max_length=4096)
    x_vector_only_mode: bool | None = None
    initial_codec_chunk_frames: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    sampling_params_list: list[dict[str, Any] | None] | dict[str, Any] | None = None


async def uploaded_voice(body: SpeechRequest, voices: VoiceStore | None) -> dict[str, Any] | None:
    """The uploaded voice `voice` names, for the talker alone: its prompt (made once, at
    the upload or by the first request after it), or its clip as a data: URL while no
    talker could make one; and the transcript it was uploaded with, if any (then it is
    cloned in context). A model with presets speaks its preset of that name and ignores
    it. A store that does not answer leaves the voice as sent (speech does not depend on
    the voices' store)."""
    if voices is None or body.ref_audio is not None or not body.voice:
        return None
    if not NAME.fullmatch(body.voice):
        return None
    try:
        found = await voices.voice(body.voice)
    except StoreUnavailable:
        log.warning("the voice store did not answer: voice %s is passed on as sent", body.voice)
        return None
    if found is None:
        return None
    said = found.meta.get("ref_text")
    ref_text = said if isinstance(said, str) and said else None
    prompt = found.prompt
    if prompt is None and voices.make_prompt is not None:
        try:
            prompt = await voices.make_prompt(found.clip, ref_text)
        except ClipRefused as exc:
            raise BadRequest(
                f"voice: {body.voice}'s clip is refused ({exc}): upload it again", param="voice"
            ) from None
        if prompt is not None:
            with contextlib.suppress(StoreUnavailable):  # made again by a later request
                await voices.set_prompt(body.voice, found, prompt)
    uploaded: dict[str, Any] = (
        {"voice_prompt": prompt}
        if prompt is not None
        else {"voice_clip": "data:audio/wav;base64," + base64.b64encode(found.clip).decode()}
    )
    if ref_text:
        uploaded["voice_ref_text"] = ref_text
    return uploaded


def speech_plan(
    pipeline: ResolvedPipeline, body: SpeechRequest
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Each stage's parameters for the request, and the stages whose outputs come back."""
    thinker = stage_with_role(pipeline, Role.THINKER)
    talker = stage_with_role(pipeline, Role.TALKER)
    code2wav = stage_with_role(pipeline, Role.CODE2WAV)
    reader = thinker or talker  # the stage that reads the text
    if reader is None or code2wav is None:
        raise BadRequest(f"model {shown(body.model)} does not produce speech", param="model")
    if body.stream_format == "sse" and body.response_format == "wav":
        raise BadRequest(
            "stream_format sse sends the audio in pieces, and a WAV's header needs its "
            "length: ask for pcm, mp3, aac, opus or flac",
            param="response_format",
        )
    refuse_fields_not_taken(body, pipeline.pipeline)
    overrides = sampling_overrides(pipeline, body.sampling_params_list)
    if body.max_new_tokens is not None and talker is not None:
        overrides[talker] = {**overrides.get(talker, {}), "max_tokens": body.max_new_tokens}
        check_token_range(
            {**pipeline.stage(talker).sampling, **overrides[talker]},
            in_entry=False,
            top_level="max_new_tokens",
        )
    common = {
        "voice": body.voice,
        "seed": body.seed if body.seed is not None else random.randrange(2**31),
        # Only the fields its type takes are set (refuse_fields_not_taken).
        **{name: getattr(body, name) for name in taken_fields(body)},
    }
    params: dict[str, dict[str, Any]] = {
        s.name: {**common, "sampling": overrides.get(s.name)} for s in pipeline.stages
    }
    if thinker is not None:
        params[thinker] = {
            **params[thinker],
            "messages": [{"role": "user", "content": body.input}],
            "forced_reply": body.input,
            "audio": True,
        }
    else:
        params[reader] = {**params[reader], "input": body.input}
    # The code2wav stage encodes and stretches (stagekit/audio_output.py).
    params[code2wav] = {
        **params[code2wav],
        "response_format": body.response_format,
        "speed": body.speed,
    }
    # Under SSE the reader's result counts the input's tokens for the usage.
    return params, {code2wav, reader} if body.stream_format == "sse" else {code2wav}


async def speech_params(
    pipeline: ResolvedPipeline,
    orchestrator: Orchestrator,
    body: SpeechRequest,
    voices: VoiceStore | None,
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """speech_plan's, with the clip (and transcript) of the uploaded voice `voice` names
    for the talker."""
    uploaded = await uploaded_voice(body, voices)
    params, emitters = speech_plan(pipeline, body)
    talker = stage_with_role(pipeline, Role.TALKER)
    if uploaded is not None and talker is not None:
        params[talker] = {**params[talker], **uploaded}
    # An adapter of the thinker named as the model shapes what the talker hears.
    set_stage_lora(params, orchestrator.serving_pipeline(), body.model, None)
    return params, emitters


async def speech_outputs(
    pipeline: ResolvedPipeline,
    orchestrator: Orchestrator,
    body: SpeechRequest,
    voices: VoiceStore | None,
    usage: SpeechUsage,
) -> AsyncGenerator[Output]:
    """The outputs that carry the request's audio, its usage counted into `usage`."""
    params, emitters = await speech_params(pipeline, orchestrator, body, voices)
    return usage.audio_of(orchestrator.stream(params, emitters))


def speech_router(
    pipeline: ResolvedPipeline,
    orchestrator: Orchestrator,
    model_ids: Callable[[], set[str]],
    voices: VoiceStore | None = None,
) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/audio/speech", response_model=None, openapi_extra=json_body(SpeechRequest))
    async def speech(request: Request) -> Response:
        body = await parse_body(SpeechRequest, request)
        check_model(body.model, model_ids())
        usage = SpeechUsage()
        outputs = await speech_outputs(pipeline, orchestrator, body, voices, usage)
        if body.response_format == "wav":
            pcm, rate = bytearray(), DEFAULT_SAMPLE_RATE

            async def collect() -> None:
                nonlocal rate
                async with contextlib.aclosing(outputs):
                    async for output in outputs:
                        pcm.extend(pcm_of(output.data))
                        rate = int(output.data["sample_rate"])

            await unless_disconnected(request, collect())
            return Response(wav_bytes(bytes(pcm), rate), media_type="audio/wav")
        # Wait for the first piece before the status line, so errors keep their status.
        first = await unless_disconnected(request, first_output(outputs))
        rate = int(first.data["sample_rate"]) if first else DEFAULT_SAMPLE_RATE

        async def pieces() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(outputs):
                if first is not None:
                    yield pcm_of(first.data)
                async for output in outputs:
                    yield pcm_of(output.data)

        if body.stream_format == "sse":
            return StreamingResponse(sse_events(pieces(), usage), media_type="text/event-stream")
        headers = {"X-Sample-Rate": str(rate)}
        if body.response_format == "pcm":
            headers["X-Sample-Format"] = "s16le"
        return StreamingResponse(
            pieces(), media_type=MEDIA_TYPES[body.response_format], headers=headers
        )

    return router
