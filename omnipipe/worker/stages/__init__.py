"""Stage implementations by role."""

from __future__ import annotations

from omnipipe.api import ResolvedStage
from omnipipe.api.spec import Role
from omnipipe.worker.stages.base import Stage


def stage_class(spec: ResolvedStage) -> type[Stage]:
    from omnipipe.worker.stages import qwen_image

    classes: dict[Role, type[Stage]] = {
        Role.TEXT_ENCODER: qwen_image.TextEncodeStage,
        Role.DENOISER: qwen_image.DenoiseStage,
        Role.VAE_DECODER: qwen_image.DecodeStage,
    }
    if spec.role not in classes:
        raise NotImplementedError(f"stage role {spec.role} is not implemented by this worker yet")
    return classes[spec.role]
