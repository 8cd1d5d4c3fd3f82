"""What the talker and code2wav stages of every Qwen Omni family share: how they take their
upstream chunks and when they send downstream. Subclasses run the model.

A talker "code" here is one step of the talker: one codec code (Qwen2.5-Omni) or one
frame of num_code_groups codes (Qwen3-Omni)."""

from __future__ import annotations

import base64
import dataclasses
from abc import abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnipipe.stagekit.audio_output import speech_encoder
from omnipipe.stagekit.media import pcm16
from omnipipe.stagekit.sampling import Sampling
from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    StageInputError,
    StepOutcome,
    StepResult,
    StreamingStage,
    Tensors,
)

SAMPLE_RATE = 24_000


def chunk_codes(engine_args: dict[str, Any], default: int) -> int:
    """engineArgs.chunk_codes: codes (frames) per chunk to code2wav, at least one."""
    value = int(engine_args.get("chunk_codes", default))
    if value < 1:
        raise ValueError(f"engineArgs.chunk_codes must be at least 1, not {value}")
    return value


def seed_of(params: dict[str, Any]) -> int | None:
    """The request's seed, when it chose one."""
    seed = params.get("seed")
    return seed if isinstance(seed, int) else None


class CodecTalkerStage(StreamingStage):
    # Set by load(): built-in defaults merged with the spec's sampling, codes per chunk
    # sent to code2wav, and how many codes make a second of audio.
    sampling: Sampling
    chunk_codes: int
    codes_per_second: float


class TalkerSessionBase(Session):
    """Takes the thinker's chunks (its prompt package, then one reply row per token) and
    sends the codes made downstream chunk_codes at a time; how codes are made is the
    subclass's (one request's forwards here, or a shared engine)."""

    def __init__(self, stage: CodecTalkerStage, params: dict[str, Any]) -> None:
        self.sampling = Sampling.from_params(stage.sampling, params.get("sampling"))
        seed = params.get("seed")
        if self.sampling.seed is None and isinstance(seed, int):
            # The request's seed makes the whole chain reproducible, not just the text.
            self.sampling = dataclasses.replace(self.sampling, seed=seed)
        self.generator = self.sampling.generator(stage.device)
        self.chunk_codes = stage.chunk_codes
        self.codes_per_second = stage.codes_per_second
        self.prompt: Tensors | None = None
        self.replies: deque[torch.Tensor] = deque()  # the thinker's rows, as sent
        self.upstream_done = False
        self.sent = 0

    @property
    @abstractmethod
    def made(self) -> list[Any]:
        """The codes made so far, in order; what is sent downstream."""

    def _take(self, chunks: Sequence[Chunk]) -> None:
        for chunk in chunks:
            if "prompt_embeds" in chunk.tensors:
                self.prompt = chunk.tensors
            if "reply" in chunk.tensors:
                self.replies.extend(torch.split(chunk.tensors["reply"], 1))
            self.upstream_done = self.upstream_done or chunk.final

    def _emit(self, done: bool) -> StepResult:
        made = self.made
        if len(made) - self.sent < self.chunk_codes and not done:
            return StepResult()
        chunk = made[self.sent :]
        self.sent = len(made)
        return StepResult(
            tensors={"codes": torch.tensor(chunk, dtype=torch.long)} if chunk else {},
            done=done,
            audio_seconds=len(chunk) / self.codes_per_second,
        )


class CodecTalkerSession(TalkerSessionBase):
    """Prefills once the prompt and the first row are in, then steps once per reply row,
    one request's forwards at a time."""

    def __init__(self, stage: CodecTalkerStage, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        self.cache: Any = None  # its own KV cache, and its rope deltas
        self.rope_deltas: torch.Tensor | None = None

    @abstractmethod
    def _prefill(self) -> torch.Tensor:
        """Run the prompt; the logits for the first code."""

    @abstractmethod
    def _next_row(self) -> torch.Tensor | None:
        """The text row the next step consumes; None until the thinker sends more."""

    @abstractmethod
    def _forward(self, row: torch.Tensor) -> torch.Tensor:
        """One step on the last code and the text row; the logits for the next code."""

    @abstractmethod
    def _choose(self, logits: torch.Tensor) -> bool:
        """Sample the next code and record it; True when the answer is complete."""

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        self._take(chunks)
        with torch.inference_mode():
            if self.cache is None:
                if self.prompt is None or not self.replies:
                    if self.upstream_done:
                        raise StageInputError("the thinker ended without a reply for the talker")
                    return None
                logits = self._prefill()
            else:
                row = self._next_row()
                if row is None:
                    return None
                logits = self._forward(row)
        return self._emit(self._choose(logits))

    def close(self) -> None:
        self.cache = None


@dataclass(frozen=True)
class Decode:
    """A chunk a code2wav session is ready to decode: codes[context:] are new, and the
    session has decoded up to `end` once it is done."""

    codes: torch.Tensor
    context: int
    end: int


class ChunkedCode2WavStage(StreamingStage):
    # Set by load(): codes decoded per chunk, and codes of left context decoded again.
    chunk_codes: int
    context_codes: int

    def decode_many(
        self, sessions: Sequence[ChunkedCode2WavSession], decodes: Sequence[Decode]
    ) -> list[np.ndarray]:
        """Each session's audio for its decode; all have equal code and context lengths.
        One at a time here; a stage whose model takes a batch runs them as one forward."""
        return [s._decode(d.codes, d.context) for s, d in zip(sessions, decodes, strict=True)]

    def step_sessions(self, work: Sequence[tuple[Session, Sequence[Chunk]]]) -> list[StepOutcome]:
        """The sessions ready to decode a chunk of the same length (and left context) are
        decoded together: the requests' chunks share forwards. The runtime hands over at
        most maxBatch sessions a call."""
        outcomes: list[StepOutcome] = []
        ready: dict[tuple[int, int], list[tuple[int, ChunkedCode2WavSession, Decode]]] = {}
        for i, (session, chunks) in enumerate(work):
            assert isinstance(session, ChunkedCode2WavSession)
            planned: Decode | StepOutcome
            try:
                planned = session.plan(chunks)
            except Exception as exc:
                planned = exc
            if isinstance(planned, Decode):
                ready.setdefault((len(planned.codes), planned.context), []).append(
                    (i, session, planned)
                )
                planned = None  # filled in below
            outcomes.append(planned)
        for group in ready.values():
            sessions, decodes = [s for _, s, _ in group], [d for _, _, d in group]
            audio: list[np.ndarray | Exception]
            try:
                with torch.inference_mode():
                    audio = list(self.decode_many(sessions, decodes))
            except Exception as exc:
                # One request's bad input must not fail its batch-mates: each alone.
                audio = (
                    [exc]
                    if len(group) == 1
                    else [self._decode_alone(s, d) for s, d in zip(sessions, decodes, strict=True)]
                )
            for (i, session, decode), made in zip(group, audio, strict=True):
                outcomes[i] = made if isinstance(made, Exception) else session.finish(decode, made)
            self.progress()
        return outcomes

    def _decode_alone(
        self, session: ChunkedCode2WavSession, decode: Decode
    ) -> np.ndarray | Exception:
        try:
            with torch.inference_mode():
                return self.decode_many([session], [decode])[0]
        except Exception as exc:
            return exc


class ChunkedCode2WavSession(Session):
    """Collects the talker's codes and decodes them in fixed chunks of chunk_codes, each
    with up to context_codes of left context decoded again so chunks join smoothly. The
    chunk boundaries do not depend on how the codes arrived."""

    def __init__(self, stage: ChunkedCode2WavStage, params: Mapping[str, Any]) -> None:
        self.device = stage.device
        # /v1/audio/speech's response_format and speed; chat's audio stays PCM.
        self.encoder = speech_encoder(params, SAMPLE_RATE)
        self.chunk_codes = stage.chunk_codes
        self.context_codes = stage.context_codes
        self.parts: list[torch.Tensor] = []
        self.count = 0
        self.decoded = 0
        self.upstream_done = False

    @abstractmethod
    def _decode(self, codes: torch.Tensor, context: int) -> np.ndarray:
        """Audio for codes[context:], decoding the first `context` codes as left context."""

    def close(self) -> None:
        self.parts = []
        if self.encoder is not None:
            self.encoder.close()

    def plan(self, chunks: Sequence[Chunk]) -> Decode | StepResult | None:
        """Take the chunks; the next chunk to decode, if a whole one (or the last) is in."""
        for chunk in chunks:
            if "codes" in chunk.tensors:
                self.parts.append(chunk.tensors["codes"])
                self.count += len(chunk.tensors["codes"])
            self.upstream_done = self.upstream_done or chunk.final
        if self.decoded == self.count:
            return self.last() if self.upstream_done else None
        end = min(self.decoded + self.chunk_codes, self.count)
        if end - self.decoded < self.chunk_codes and not self.upstream_done:
            return None
        codes = torch.cat(self.parts)
        self.parts = [codes]
        context = min(self.context_codes, self.decoded)
        return Decode(codes[self.decoded - context : end].to(self.device), context, end)

    def _output(self, data: bytes) -> list[dict[str, Any]]:
        if self.encoder is not None and not data:
            return []  # the encoder holds this piece until it fills a frame
        return [{"audio": base64.b64encode(data).decode(), "sample_rate": SAMPLE_RATE}]

    def finish(self, decode: Decode, audio: np.ndarray) -> StepResult:
        self.decoded = decode.end
        pcm = pcm16(audio)
        return StepResult(
            outputs=self._output(self.encoder.push(pcm) if self.encoder else pcm),
            audio_seconds=len(audio) / SAMPLE_RATE,
        )

    def last(self) -> StepResult:
        """The end: what the encoder still holds (the stretch's tail, the last frame)."""
        tail = self.encoder.finish() if self.encoder is not None else b""
        # The last piece, empty when nothing is left, says how many codes became audio:
        # the speech's usage counts them as its output tokens.
        last = {"audio": base64.b64encode(tail).decode(), "sample_rate": SAMPLE_RATE}
        return StepResult(outputs=[{**last, "codes": self.count}], done=True)

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        planned = self.plan(chunks)
        if not isinstance(planned, Decode):
            return planned
        with torch.inference_mode():
            audio = self._decode(planned.codes, planned.context)
        return self.finish(planned, audio)
