"""Qwen3-TTS's code2wav stage: the talker's frames to 24 kHz audio in fixed chunks, each
decoded with enough left context that the audio equals the whole decode (the stage
kit's chunked code2wav), several requests' equal chunks in one forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from omnipipe.families.qwen3_tts.code2wav_model import load_code2wav
from omnipipe.stagekit.code2wav import ChunkedCode2WavSession, ChunkedCode2WavStage, Decode
from omnipipe.stagekit.stage import Session, StageJob

CHUNK_FRAMES = 25


class Code2WavStage(ChunkedCode2WavStage):
    def load(self) -> None:
        self.model = load_code2wav(self.model_path, self.device)
        args = self.spec.engine_args
        self.chunk_codes = int(args.get("chunk_codes", CHUNK_FRAMES))
        # By default every frame that reaches a chunk's audio is decoded again before it
        # (exact); fewer trade that for speed on long speech.
        self.context_codes = int(args.get("context_codes", self.model.context_frames))
        if self.chunk_codes < 1 or self.context_codes < 0:
            raise ValueError("engineArgs: chunk_codes must be at least 1, context_codes >= 0")

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

    def _decode(self, codes: torch.Tensor, context: int) -> np.ndarray:
        audio = self.stage.model(codes.T[None])  # frames x groups -> 1 x groups x frames
        new = audio[..., context * self.stage.model.samples_per_frame :].reshape(-1)
        decoded: np.ndarray = new.float().cpu().numpy()
        return decoded
