"""/v1/audio/voices, vLLM-Omni's voices API: a voice uploaded once (a reference clip, its
speaker's consent, a name) is spoken by name in /v1/audio/speech's `voice` on a model
that clones (Qwen3-TTS Base), and listed and deleted. The clip is kept in the router's
Redis (router/voice_store.py), so every router replica of the pipeline speaks it and a
restarted router still does, with its prompt: what a talker made of the clip at the
upload (its x-vector, and its codes when it came with its transcript), made once and sent
with each request that names it. The clip is checked from its WAV header here: bytes,
seconds and sample rate; the talker refuses what it cannot encode (a 400 too). The
listing also names the model's preset voices, on every pipeline that speaks."""

from __future__ import annotations

import io
import re
import struct
import time
import wave
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from omnipipe.api.plain_text import shown
from omnipipe.router.errors import BadRequest, Conflict, ModelNotFound
from omnipipe.router.voice_store import ClipRefused, VoicesFull, VoiceStore, VoiceTaken

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_CLIP_BYTES = 10 << 20  # vLLM-Omni's
MAX_CLIP_SECONDS = 60.0
SAMPLE_RATES = (8_000, 192_000)
MAX_REF_TEXT = 4096


class VoiceNotFound(ModelNotFound):
    """404, in OpenAI's shape."""


def voice_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadRequest(
            f"name: {shown(name)} is not a voice name (letters, digits, '_', '.' and '-', "
            "up to 64, starting with a letter or digit)",
            param="name",
        )
    return name


def clip_facts(clip: bytes) -> dict[str, Any]:
    """A WAV's seconds and rate, from its header, within the limits; a 400 naming the
    limit otherwise."""
    try:
        with wave.open(io.BytesIO(clip)) as wav:
            rate, frames = wav.getframerate(), wav.getnframes()
            channels, width = wav.getnchannels(), wav.getsampwidth()
    except (wave.Error, EOFError, ValueError, struct.error):
        raise BadRequest(
            "audio_sample: not a WAV file this server reads (PCM 8 to 32-bit)",
            param="audio_sample",
        ) from None
    if not SAMPLE_RATES[0] <= rate <= SAMPLE_RATES[1] or not 1 <= width <= 4 or channels < 1:
        raise BadRequest(
            f"audio_sample: {rate} Hz, {8 * width}-bit: a voice's clip is PCM at "
            f"{SAMPLE_RATES[0]} to {SAMPLE_RATES[1]} Hz",
            param="audio_sample",
        )
    seconds = frames / rate
    if seconds > MAX_CLIP_SECONDS or frames == 0:
        raise BadRequest(
            f"audio_sample: the clip is {seconds:.1f} s; a voice's clip is up to "
            f"{MAX_CLIP_SECONDS:g} s, and not empty",
            param="audio_sample",
        )
    return {"seconds": round(seconds, 3), "sample_rate": rate}


async def _upload(request: Request) -> tuple[dict[str, str], bytes]:
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise BadRequest(
            "a voice is uploaded as multipart/form-data: audio_sample (a WAV file), name, "
            "consent and, optionally, ref_text"
        )
    try:
        form = await request.form(max_files=1, max_fields=8, max_part_size=MAX_REF_TEXT)
    except HTTPException as exc:
        raise BadRequest(f"malformed multipart form: {exc.detail}") from None
    try:
        fields: dict[str, str] = {}
        clip = None
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key != "audio_sample":
                    raise BadRequest(f"{shown(key)}: a file where a text field belongs")
                clip = await value.read(MAX_CLIP_BYTES + 1)
            else:
                fields[key] = value
        if clip is None:
            raise BadRequest(
                "audio_sample: the voice's clip (a WAV file) is required", "audio_sample"
            )
        if len(clip) > MAX_CLIP_BYTES:
            raise BadRequest(
                f"audio_sample: over the {MAX_CLIP_BYTES >> 20} MiB a voice's clip may be",
                param="audio_sample",
            )
        return fields, clip
    finally:
        await form.close()


Presets = Callable[[], Awaitable[list[str]]]


async def check_preset_voice(voice: str | None, presets: Presets) -> None:
    """A voice that a model with preset voices lacks (they are matched as its talker
    matches them, whatever the case): refused once, before any text is spoken, not by
    each sentence's talker. A model without presets (one that clones) is not asked."""
    named = await presets()
    if voice and named and voice.lower() not in {n.lower() for n in named}:
        raise BadRequest(
            f"voice: {shown(voice)} is not one of this model's voices ({', '.join(named)})",
            param="voice",
        )


async def _prompt(store: VoiceStore, clip: bytes, ref_text: str | None) -> dict[str, Any] | None:
    """The voice's prompt, made now by a talker; None when none can make it now (the
    first request that speaks the voice makes it)."""
    if store.make_prompt is None:
        return None
    try:
        return await store.make_prompt(clip, ref_text)
    except ClipRefused as exc:
        reason = str(exc).removeprefix("ref_audio: ")
        raise BadRequest(f"audio_sample: {reason}", param="audio_sample") from None


def voices_router(store: VoiceStore | None, presets: Presets) -> APIRouter:
    """The listing for every pipeline that speaks: the model's preset voices (asked of its
    stages), then the uploaded ones; upload and delete where voices are kept (`store`)."""
    router = APIRouter()

    @router.get("/v1/audio/voices", response_model=None)
    async def listing() -> dict[str, Any]:
        named = await presets()
        uploaded = await store.listed() if store is not None else []
        return {
            "object": "list",
            "data": [
                *({"object": "voice", "name": n, "preset": True} for n in named),
                *({**v, "preset": False} for v in uploaded),
            ],
            # vLLM-Omni's fields: every name, and the uploaded voices' entries.
            "voices": [*named, *(v["name"] for v in uploaded if v["name"] not in named)],
            "uploaded_voices": uploaded,
        }

    if store is None:
        return router

    @router.post("/v1/audio/voices", response_model=None)
    async def upload(request: Request) -> dict[str, Any]:
        fields, clip = await _upload(request)
        name = voice_name(fields.get("name"))
        if fields.get("consent", "").strip().lower() != "true":
            raise BadRequest(
                "consent: cloning a voice needs its speaker's consent; send consent=true once "
                "you have it",
                param="consent",
            )
        ref_text = fields.get("ref_text") or None
        voice = {
            "object": "voice",
            "name": name,
            "created_at": int(time.time()),
            **clip_facts(clip),
            "ref_text": ref_text,
        }
        prompt = await _prompt(store, clip, ref_text)
        try:
            await store.add(name, clip, voice, prompt)
        except VoiceTaken:
            raise Conflict(f"voice {name!r} exists: delete it first", param="name") from None
        except VoicesFull:
            raise BadRequest(
                f"this pipeline keeps at most {store.max_voices} voices: delete one first",
                param="name",
            ) from None
        return voice

    @router.delete("/v1/audio/voices/{name}", response_model=None)
    async def delete(name: str) -> dict[str, Any]:
        if not NAME.fullmatch(name) or not await store.delete(name):
            raise VoiceNotFound(f"voice {shown(name)} does not exist", param="name")
        return {"object": "voice.deleted", "name": name, "deleted": True}

    return router
