"""WS /v1/audio/speech/stream: text in as it is written, speech out a sentence at a time,
in one voice, as one stream (vLLM-Omni's protocol, with input.cancel added).

Client: session.config (the speech request's fields but input, plus stream_audio; again
between utterances to change them), input.text, input.done (speak the rest and end the
utterance; the connection stays), input.cancel (stop speaking and drop what is buffered),
session.close. Server: audio.start, the audio as binary frames (one per sentence, or
chunks as made with stream_audio), audio.done, session.done per utterance, and error
events, which end nothing but what they name."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from omnipipe.api import ResolvedPipeline
from omnipipe.router.api.audio import pcm_of, wav_bytes
from omnipipe.router.api.common import bad_request, check_model
from omnipipe.router.api.sentences import SentenceSplitter
from omnipipe.router.api.speech import (
    DEFAULT_SAMPLE_RATE,
    SpeechRequest,
    SpeechUsage,
    speech_outputs,
    speech_plan,
)
from omnipipe.router.api.voices import Presets, check_preset_voice
from omnipipe.router.errors import BadRequest, OpenAIError
from omnipipe.router.middleware import MAX_BODY_SEPARATORS
from omnipipe.router.orchestrator import Orchestrator
from omnipipe.router.voice_store import VoiceStore

log = logging.getLogger(__name__)
# Sentences waiting to be spoken: a client that writes far faster than speech is made is
# told so, not left to grow the router's memory.
MAX_QUEUED_SENTENCES = 256
# One input.text message at most: as much as one speech request's input.
MAX_TEXT_CHARS = 4096
# A connection with nothing to speak and no message for this long is closed.
IDLE_SECONDS = 300.0
# What the placeholder text of a config's check holds: no field of it is read.
_PLACEHOLDER = "."


@dataclass
class Sentence:
    utterance: int
    index: int
    text: str
    config: SpeechRequest
    stream_audio: bool
    started: bool = False  # audio.start sent
    sent: int = 0  # audio bytes sent


@dataclass
class UtteranceEnd:
    utterance: int
    sentences: int
    cancelled: bool = False


@dataclass
class Session:
    config: SpeechRequest | None = None
    stream_audio: bool = False
    utterance: int = 0
    sentences: int = 0
    splitter: SentenceSplitter = field(default_factory=SentenceSplitter)
    seed: int = field(default_factory=lambda: random.randrange(2**31))


def error_event(exc: OpenAIError) -> dict[str, Any]:
    """OpenAI's realtime error event; `message` also at the top, as vLLM-Omni sends it."""
    return {"type": "error", "message": exc.message, "error": exc.body()}


class SpeechStream:
    """One connection: a reader of the client's messages and a speaker of the queued
    sentences, in order, one at a time."""

    def __init__(
        self,
        ws: WebSocket,
        pipeline: ResolvedPipeline,
        orchestrator: Orchestrator,
        model_ids: Callable[[], set[str]],
        voices: VoiceStore | None,
        presets: Presets,
    ) -> None:
        self.ws, self.pipeline, self.orchestrator = ws, pipeline, orchestrator
        self.model_ids, self.voices, self.presets = model_ids, voices, presets
        self.session = Session()
        self.queue: asyncio.Queue[Sentence | UtteranceEnd] = asyncio.Queue()
        self.speaking: asyncio.Task[None] | None = None
        # The sentence being spoken, in a task of its own: input.cancel stops it alone,
        # and never waits for it.
        self.current: asyncio.Task[None] | None = None
        self.sending = asyncio.Lock()

    async def send(self, event: dict[str, Any] | bytes) -> None:
        async with self.sending:
            if isinstance(event, bytes):
                await self.ws.send_bytes(event)
            else:
                await self.ws.send_text(json.dumps(event))

    async def run(self) -> None:
        self.speaking = asyncio.create_task(self.speak())
        try:
            await self.read()
        finally:
            for task in (self.current, self.speaking):
                if task is not None:
                    task.cancel()
            await asyncio.gather(
                *(t for t in (self.current, self.speaking) if t is not None),
                return_exceptions=True,
            )

    async def read(self) -> None:
        while True:
            idle = self.queue.empty() and not self.session.splitter.buffer
            try:
                message = await asyncio.wait_for(self.ws.receive(), IDLE_SECONDS if idle else None)
            except TimeoutError:
                await self.ws.close(1000, f"no message for {IDLE_SECONDS:g} s")
                return
            if message["type"] == "websocket.disconnect":
                return
            try:
                if not await self.handle(message):
                    await self.ws.close(1000)
                    return
            except OpenAIError as exc:
                await self.send(error_event(exc))

    async def handle(self, message: Mapping[str, Any]) -> bool:
        """One client message; False once the client closes the session."""
        if message.get("text") is None:
            raise BadRequest("messages are JSON text frames; a binary frame was sent")
        text = message["text"]
        # As an HTTP body's (router/middleware.py): JSON members cost the loop a
        # microsecond each, and a config is a few dozen.
        if text.count(",") + text.count(":") > MAX_BODY_SEPARATORS:
            raise BadRequest(
                f"a message holds over {MAX_BODY_SEPARATORS} commas and colons: far more than "
                "any message of this protocol needs"
            )
        try:
            event = json.loads(text)
        except (ValueError, RecursionError):  # nested past the parser's depth: no message
            raise BadRequest("a message is not JSON") from None
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "session.config":
            await self.configure(event)
        elif kind == "input.text":
            text = event.get("text")
            if not isinstance(text, str):
                raise BadRequest("input.text: text must be a string", param="text")
            if len(text) > MAX_TEXT_CHARS:
                raise BadRequest(
                    f"input.text: at most {MAX_TEXT_CHARS} characters a message; send the "
                    "text in smaller pieces",
                    param="text",
                )
            if self.session.config is None:
                raise BadRequest("send session.config before input.text", param="type")
            await self.enqueue(self.session.splitter.feed(text))
        elif kind == "input.done":
            await self.enqueue(self.session.splitter.flush())
            self.end_utterance(cancelled=False)
        elif kind == "input.cancel":
            await self.cancel()
        elif kind == "session.close":
            return False
        else:
            raise BadRequest(
                f"unknown message type {json.dumps(kind)[:80]}: session.config, input.text, "
                "input.done, input.cancel or session.close",
                param="type",
            )
        return True

    async def configure(self, event: dict[str, Any]) -> None:
        session = self.session
        if session.splitter.buffer:
            raise BadRequest(
                "session.config while text is buffered: send input.done or input.cancel first",
                param="type",
            )
        fields = {k: v for k, v in event.items() if k not in ("type", "stream_audio")}
        stream_audio = event.get("stream_audio", False)
        if not isinstance(stream_audio, bool):
            raise BadRequest("stream_audio must be true or false", param="stream_audio")
        for name in ("input", "stream_format"):
            if name in fields:
                raise BadRequest(
                    f"{name} is not a session field: text comes in input.text messages and "
                    "audio as binary frames",
                    param=name,
                )
        try:
            config = SpeechRequest.model_validate({**fields, "input": _PLACEHOLDER}, strict=True)
        except ValidationError as exc:
            raise bad_request(exc, fields) from None
        check_model(config.model, self.model_ids())
        if stream_audio and config.response_format == "wav":
            raise BadRequest(
                "stream_audio sends each sentence in pieces, and a WAV's header needs its "
                "length: ask for pcm, mp3, aac, opus or flac",
                param="response_format",
            )
        # Every sentence is spoken with the session's seed, whatever else a later config
        # changes: one voice, not one per sentence.
        if config.seed is None:
            config = config.model_copy(update={"seed": session.seed})
        speech_plan(self.pipeline, config)  # what the model cannot take is refused now
        await check_preset_voice(config.voice, self.presets)
        session.config, session.stream_audio = config, stream_audio

    def check_room(self, dropped: str) -> None:
        if self.queue.qsize() >= MAX_QUEUED_SENTENCES:
            self.session.splitter.clear()
            raise BadRequest(
                f"{MAX_QUEUED_SENTENCES} sentences and utterance ends already wait to be "
                f"spoken: {dropped} is dropped; wait for audio before sending more"
            )

    async def enqueue(self, texts: list[str]) -> None:
        session = self.session
        for text in texts:
            self.check_room(f"text from {json.dumps(text[:40])} on")
            assert session.config is not None  # input.text needs one; a flush follows it
            self.queue.put_nowait(
                Sentence(
                    session.utterance,
                    session.sentences,
                    text,
                    session.config,
                    session.stream_audio,
                )
            )
            session.sentences += 1

    def end_utterance(self, cancelled: bool) -> None:
        session = self.session
        if not cancelled:  # a cancel has just emptied the queue
            self.check_room("this input.done")
        self.queue.put_nowait(UtteranceEnd(session.utterance, session.sentences, cancelled))
        session.utterance += 1
        session.sentences = 0

    async def cancel(self) -> None:
        """Stop speaking: the sentence being spoken (its stages cancelled) and every one
        waiting, of this utterance and of those already ended, each of which still gets
        its session.done (cancelled)."""
        self.session.splitter.clear()
        ended: list[UtteranceEnd] = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, UtteranceEnd):
                ended.append(UtteranceEnd(item.utterance, item.sentences, cancelled=True))
        if self.current is not None:
            self.current.cancel()
        for end in ended:
            self.queue.put_nowait(end)
        self.end_utterance(cancelled=True)

    async def speak(self) -> None:
        while True:
            item = await self.queue.get()
            if isinstance(item, UtteranceEnd):
                await self.send(
                    {
                        "type": "session.done",
                        "utterance_index": item.utterance,
                        "total_sentences": item.sentences,
                        "cancelled": item.cancelled,
                    }
                )
                continue
            self.current = asyncio.create_task(self.speak_one(item))
            try:
                await asyncio.wait({self.current})
            finally:
                if not self.current.done():  # the connection is closing
                    self.current.cancel()
            if self.current.cancelled() and item.started:
                # Stopped by input.cancel: its audio ends here.
                where = {"utterance_index": item.utterance, "sentence_index": item.index}
                await self.send(
                    {
                        "type": "audio.done",
                        **where,
                        "total_bytes": item.sent,
                        "error": False,
                        "cancelled": True,
                    }
                )

    async def speak_one(self, sentence: Sentence) -> None:
        config = sentence.config
        where = {"utterance_index": sentence.utterance, "sentence_index": sentence.index}
        body = config.model_copy(update={"input": sentence.text})
        total, error = 0, False
        whole = bytearray()
        rate = DEFAULT_SAMPLE_RATE

        async def start() -> None:
            sentence.started = True
            await self.send(
                {
                    "type": "audio.start",
                    **where,
                    "sentence_text": sentence.text,
                    "format": config.response_format,
                    "sample_rate": rate,
                }
            )

        try:
            outputs = await speech_outputs(
                self.pipeline, self.orchestrator, body, self.voices, SpeechUsage()
            )
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    rate = int(output.data["sample_rate"])
                    if not sentence.started:
                        await start()
                    piece = pcm_of(output.data)
                    total += len(piece)
                    if sentence.stream_audio:
                        await self.send(piece)
                        sentence.sent = total
                    else:
                        whole.extend(piece)
        except OpenAIError as exc:
            error = True
            await self.send({**error_event(exc), **where})
        except (WebSocketDisconnect, asyncio.CancelledError):
            raise
        except Exception:
            log.exception(
                "speaking sentence %s of utterance %s", sentence.index, sentence.utterance
            )
            error = True
            await self.send(
                {**error_event(OpenAIError("the sentence could not be spoken")), **where}
            )
        if not error and not sentence.started:
            await start()  # a sentence that made no audio: told, as one that did
        if not error and not sentence.stream_audio:
            audio = wav_bytes(bytes(whole), rate) if config.response_format == "wav" else whole
            total = len(audio)
            await self.send(bytes(audio))
        await self.send(
            {
                "type": "audio.done",
                **where,
                "total_bytes": total,
                "error": error,
                "cancelled": False,
            }
        )


def speech_stream_router(
    pipeline: ResolvedPipeline,
    orchestrator: Orchestrator,
    model_ids: Callable[[], set[str]],
    voices: VoiceStore | None,
    presets: Presets,
) -> APIRouter:
    router = APIRouter()

    @router.websocket("/v1/audio/speech/stream")
    async def speech_stream(ws: WebSocket) -> None:
        await ws.accept()
        with contextlib.suppress(WebSocketDisconnect):
            await SpeechStream(ws, pipeline, orchestrator, model_ids, voices, presets).run()

    return router
