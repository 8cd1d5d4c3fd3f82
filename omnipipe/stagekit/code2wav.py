"""A code2wav stage that decodes a talker's codes in fixed chunks with left context, as
a codec's chunked decode does, several requests' equal chunks in one forward: what every
speech family's code2wav shares (Qwen-Omni's, Qwen3-TTS's). Subclasses run the model."""

from __future__ import annotations

import base64
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnipipe.stagekit.audio_output import speech_encoder
from omnipipe.stagekit.media import pcm16
from omnipipe.stagekit.stage import Chunk, Session, StepOutcome, StepResult, StreamingStage

SAMPLE_RATE = 24_000


def chunk_codes(engine_args: Mapping[str, Any], default: int) -> int:
    """engineArgs.chunk_codes: codes (frames) per chunk to code2wav, at least one."""
    value = int(engine_args.get("chunk_codes", default))
    if value < 1:
        raise ValueError(f"engineArgs.chunk_codes must be at least 1, not {value}")
    return value


def decode_causal(
    decoder: Callable[[torch.Tensor], torch.Tensor],
    codes: Sequence[torch.Tensor],
    context: int,
    samples_per_code: int,
) -> list[np.ndarray]:
    """The new audio of each request's codes (codes x groups, all of one length) through a
    deterministic decoder that takes batch x groups x codes, in one forward: what follows
    the first `context` codes' samples."""
    waveforms = decoder(torch.stack([c.T for c in codes]))
    new = waveforms[..., context * samples_per_code :].reshape(len(codes), -1).float().cpu()
    return [row.numpy() for row in new]


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
        self.prefix = 0  # leading codes decoded as context only (a codec's in-context prompt)
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
        context, limit = self.span(self.decoded)
        whole = min(self.chunk_codes, limit - self.decoded)
        end = min(self.decoded + whole, self.count)
        if end - self.decoded < whole and not self.upstream_done:
            return None
        codes = torch.cat(self.parts)
        self.parts = [codes]
        return Decode(codes[self.decoded - context : end].to(self.device), context, end)

    def span(self, start: int) -> tuple[int, int]:
        """For a chunk that starts at code `start`: the codes before it decoded again as
        its left context, and the code it may not reach past (a codec whose reference
        decodes in fixed windows ends each chunk at a window's edge)."""
        return min(self.context_codes, start), start + self.chunk_codes

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
        return StepResult(outputs=[{**last, "codes": self.count - self.prefix}], done=True)

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        planned = self.plan(chunks)
        if not isinstance(planned, Decode):
            return planned
        with torch.inference_mode():
            audio = self._decode(planned.codes, planned.context)
        return self.finish(planned, audio)
