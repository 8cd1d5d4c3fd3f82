"""What a stage does and what runs it: the words a family's pipeline types and a user's
stages share."""

from __future__ import annotations

from enum import StrEnum


class Engine(StrEnum):
    TRANSFORMERS = "transformers"
    DIFFUSERS = "diffusers"
    VLLM = "vllm"


class Role(StrEnum):
    TEXT_ENCODER = "text-encoder"
    DENOISER = "denoiser"
    VAE_DECODER = "vae-decoder"
    VAE_ENCODER = "vae-encoder"
    THINKER = "thinker"
    TALKER = "talker"
    CODE2WAV = "code2wav"


# The stages whose first chunk of audio (codes or samples) the worker times
# (omnipipe_stage_time_to_first_audio_seconds): what autoscaling on first-audio-p90 reads.
AUDIO_ROLES = frozenset({Role.TALKER, Role.CODE2WAV})
