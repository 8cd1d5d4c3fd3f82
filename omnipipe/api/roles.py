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
