"""The Qwen Omni code2wav stages on transformers: the talker's codes to audio in fixed
chunks with left context (the stage kit's ChunkedCode2WavStage), several requests' equal chunks in
one forward. Qwen2.5-Omni's token2wav samples a DiT from each request's own seeded noise
(qwen25_token2wav.py), then BigVGAN; Qwen3-Omni's decoder is causal and deterministic,
decoding as transformers' chunked_decode does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from omnipipe.families.qwen_omni.checkpoint import load_qwen3_omni, load_qwen25_omni
from omnipipe.families.qwen_omni.codec import seed_of
from omnipipe.families.qwen_omni.handoff import pick_voice
from omnipipe.families.qwen_omni.qwen3 import (
    CHUNK_FRAMES,
    CONTEXT_FRAMES,
    samples_per_frame,
    voices,
)
from omnipipe.families.qwen_omni.qwen25 import CHUNK_CODES, CONTEXT_CODES, samples_per_code
from omnipipe.families.qwen_omni.qwen25_token2wav import starting_noise, synthesize
from omnipipe.stagekit.code2wav import (
    ChunkedCode2WavSession,
    ChunkedCode2WavStage,
    Decode,
    decode_causal,
)
from omnipipe.stagekit.stage import (
    Session,
    StageJob,
)

# ---- Qwen2.5-Omni: token2wav ----------------------------------------------------------


class Code2WavStage(ChunkedCode2WavStage):
    def load(self) -> None:
        self.model = load_qwen25_omni(self.model_path, self.device, "token2wav")
        self.token2wav = self.model.token2wav
        self.samples_per_code = samples_per_code(self.model.config)
        args = self.spec.engine_args
        self.num_steps = int(args.get("num_steps", 10))
        self.chunk_codes = int(args.get("chunk_codes", CHUNK_CODES))
        self.context_codes = int(args.get("context_codes", CONTEXT_CODES))

    def open(self, job: StageJob) -> Session:
        return Code2WavSession(self, job.params)

    def decode_many(
        self, sessions: Sequence[ChunkedCode2WavSession], decodes: Sequence[Decode]
    ) -> list[np.ndarray]:
        """Several requests' chunks through one DiT sampling and one vocoder pass: each
        keeps its own voice and starting noise, so its audio is what it gets alone."""
        own = [s for s in sessions if isinstance(s, Code2WavSession)]
        assert len(own) == len(sessions), "sessions of another stage"
        if len(decodes) == 1 or len({s.reference_mel.shape for s in own}) > 1:
            # Alone, or voices whose reference mels differ in length (no shipped pair
            # does): transformers' own path, one at a time.
            return super().decode_many(sessions, decodes)
        codes = torch.stack([d.codes for d in decodes])
        waveforms = synthesize(
            self.token2wav,
            torch.cat([s.conditioning for s in own]),
            torch.cat([s.reference_mel for s in own]),
            codes,
            torch.cat([s.noise(len(d.codes)) for s, d in zip(own, decodes, strict=True)]),
            self.num_steps,
        )
        new = (codes.shape[1] - decodes[0].context) * self.samples_per_code
        return [w[-new:].float().cpu().numpy() for w in waveforms]


class Code2WavSession(ChunkedCode2WavSession):
    def __init__(self, stage: Code2WavStage, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        self.stage = stage
        speaker = stage.model.speaker_map[pick_voice(params, list(stage.model.speaker_map))]
        self.conditioning = speaker["cond"].to(stage.device).float()
        self.reference_mel = speaker["ref_mel"].to(stage.device).float()
        self.seed = seed_of(params)

    def noise(self, codes: int) -> torch.Tensor:
        """This chunk's starting noise, from the seed _decode sets."""
        seed = None if self.seed is None else self.seed + self.decoded
        return starting_noise(
            self.stage.token2wav.code2wav_dit_model, codes, seed, self.stage.device
        )

    def _decode(self, codes: torch.Tensor, context: int) -> np.ndarray:
        if self.seed is not None:
            # token2wav starts from noise: the same codes and seed give the same audio.
            torch.manual_seed(self.seed + self.decoded)
        waveform = self.stage.token2wav(
            codes[None],
            conditioning=self.conditioning,
            reference_mel=self.reference_mel,
            num_steps=self.stage.num_steps,
        ).reshape(-1)
        new = (len(codes) - context) * self.stage.samples_per_code
        audio: np.ndarray = waveform[-new:].float().cpu().numpy()
        return audio


# ---- Qwen3-Omni: code2wav --------------------------------------------------------------


class Qwen3Code2WavStage(ChunkedCode2WavStage):
    def load(self) -> None:
        self.model = load_qwen3_omni(self.model_path, self.device, "code2wav")
        self.code2wav = self.model.code2wav
        self.samples_per_frame = samples_per_frame(self.model.config)
        self.voices = voices(self.model.config)
        args = self.spec.engine_args
        self.chunk_codes = int(args.get("chunk_codes", CHUNK_FRAMES))
        self.context_codes = int(args.get("context_codes", CONTEXT_FRAMES))

    def open(self, job: StageJob) -> Session:
        pick_voice(job.params, self.voices)  # the talker speaks it; a bad one fails early
        return Qwen3Code2WavSession(self, job.params)

    def decode_many(
        self, sessions: Sequence[ChunkedCode2WavSession], decodes: Sequence[Decode]
    ) -> list[np.ndarray]:
        """Several requests' chunks as one batch through the (deterministic) decoder."""
        codes = [d.codes for d in decodes]
        return decode_causal(self.code2wav, codes, decodes[0].context, self.samples_per_frame)


class Qwen3Code2WavSession(ChunkedCode2WavSession):
    """Decodes as transformers' chunked_decode does, so the audio equals its output."""

    def __init__(self, stage: Qwen3Code2WavStage, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        self.stage = stage

    def _decode(self, codes: torch.Tensor, context: int) -> np.ndarray:
        stage = self.stage
        return decode_causal(stage.code2wav, [codes], context, stage.samples_per_frame)[0]
