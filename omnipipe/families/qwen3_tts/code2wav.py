"""Qwen3-TTS's code2wav stage: the talker's frames to 24 kHz audio in chunks (the stage
kit's chunked code2wav), several requests' equal chunks in one forward.

qwen-tts decodes in windows of 300 frames, each after 25 frames of left context
(chunked_decode), and the decoder is causal: a chunk decoded from its window's context
through its own end is that window's audio, whatever the chunk's size. So chunks keep to
the windows' edges and take their window's context, and the audio equals the
reference's at any length, for the cost of at most 325 frames a decode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from omnipipe.families.qwen3_tts.code2wav_model import load_code2wav
from omnipipe.families.qwen3_tts.config import CHUNK_FRAMES, PREFIX_CODES
from omnipipe.stagekit.code2wav import (
    ChunkedCode2WavSession,
    ChunkedCode2WavStage,
    Decode,
    chunk_codes,
    decode_causal,
)
from omnipipe.stagekit.stage import Chunk, Session, StageJob, StepResult

WINDOW_FRAMES = 300  # qwen-tts's chunked_decode(chunk_size=300, left_context_size=25)
WINDOW_CONTEXT = 25


class Code2WavStage(ChunkedCode2WavStage):
    def load(self) -> None:
        self.model = load_code2wav(self.model_path, self.device)
        self.chunk_codes = chunk_codes(self.spec.engine_args, CHUNK_FRAMES)
        self.context_codes = WINDOW_CONTEXT

    def open(self, job: StageJob) -> Session:
        return Code2WavSession(self, job.params)

    def decode_many(
        self, sessions: Sequence[ChunkedCode2WavSession], decodes: Sequence[Decode]
    ) -> list[np.ndarray]:
        """Several requests' chunks as one batch through the (deterministic) decoder."""
        codes = [d.codes for d in decodes]
        return decode_causal(self.model, codes, decodes[0].context, self.model.samples_per_frame)


class Code2WavSession(ChunkedCode2WavSession):
    def __init__(self, stage: Code2WavStage, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        self.stage = stage

    def plan(self, chunks: Sequence[Chunk]) -> Decode | StepResult | None:
        """An in-context clone's first chunk brings the reference clip's codes: they lead
        the stream, its windows counted from them as qwen-tts decodes reference and
        speech as one, but are not decoded themselves (their audio is not sent): the
        speech's first chunk takes its window's context from them."""
        for chunk in chunks:
            prefix = chunk.tensors.get(PREFIX_CODES)
            if prefix is not None and self.count == 0:
                self.parts.append(prefix)
                self.count = self.decoded = self.prefix = len(prefix)
        return super().plan(chunks)

    def span(self, start: int) -> tuple[int, int]:
        window = start - start % WINDOW_FRAMES
        first = window - WINDOW_CONTEXT if window else 0
        return start - first, window + WINDOW_FRAMES

    def _decode(self, codes: torch.Tensor, context: int) -> np.ndarray:
        model = self.stage.model
        return decode_causal(model, [codes], context, model.samples_per_frame)[0]
