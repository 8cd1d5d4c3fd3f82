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
from omnipipe.stagekit.code2wav import ChunkedCode2WavSession, ChunkedCode2WavStage, Decode
from omnipipe.stagekit.stage import Session, StageJob

CHUNK_FRAMES = 25
WINDOW_FRAMES = 300  # qwen-tts's chunked_decode(chunk_size=300, left_context_size=25)
WINDOW_CONTEXT = 25


class Code2WavStage(ChunkedCode2WavStage):
    def load(self) -> None:
        self.model = load_code2wav(self.model_path, self.device)
        args = self.spec.engine_args
        self.chunk_codes = int(args.get("chunk_codes", CHUNK_FRAMES))
        if self.chunk_codes < 1:
            raise ValueError(f"engineArgs.chunk_codes must be at least 1, not {self.chunk_codes}")
        self.context_codes = WINDOW_CONTEXT

    def open(self, job: StageJob) -> Session:
        return Code2WavSession(self, job.params)

    def decode_many(
        self, sessions: Sequence[ChunkedCode2WavSession], decodes: Sequence[Decode]
    ) -> list[np.ndarray]:
        """Several requests' chunks as one batch through the (deterministic) decoder."""
        if len(decodes) == 1:
            return super().decode_many(sessions, decodes)
        audio = self.model(torch.stack([d.codes.T for d in decodes]))
        skip = decodes[0].context * self.model.samples_per_frame
        rows = audio[..., skip:].reshape(len(decodes), -1).float().cpu()
        return [row.numpy() for row in rows]


class Code2WavSession(ChunkedCode2WavSession):
    def __init__(self, stage: Code2WavStage, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        self.stage = stage

    def span(self, start: int) -> tuple[int, int]:
        window = start - start % WINDOW_FRAMES
        first = window - WINDOW_CONTEXT if window else 0
        return start - first, window + WINDOW_FRAMES

    def _decode(self, codes: torch.Tensor, context: int) -> np.ndarray:
        audio = self.stage.model(codes.T[None])
        new = audio[..., context * self.stage.model.samples_per_frame :].reshape(-1)
        decoded: np.ndarray = new.float().cpu().numpy()
        return decoded
