"""The stage classes of a Wan checkpoint, by role."""

from __future__ import annotations

from omnipipe.api import ResolvedStage
from omnipipe.api.spec import Role
from omnipipe.worker.stages.base import Stage


def stage_class(spec: ResolvedStage, model_path: str) -> type[Stage]:
    from omnipipe.families.wan import denoise, stages

    return {
        Role.TEXT_ENCODER: stages.WanEncodeStage,
        Role.DENOISER: denoise.WanDenoiseStage,
        Role.VAE_DECODER: stages.WanDecodeStage,
    }[spec.role]
