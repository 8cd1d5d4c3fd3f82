"""Stage implementations by role."""

from __future__ import annotations

from omnipipe.api import ResolvedStage
from omnipipe.api.spec import Role
from omnipipe.worker.stages.base import Stage

IMPLEMENTED_ROLES = frozenset(
    {
        Role.TEXT_ENCODER,
        Role.DENOISER,
        Role.VAE_DECODER,
        Role.THINKER,
        Role.TALKER,
        Role.CODE2WAV,
    }
)


def unimplemented_stages(stages: list[ResolvedStage]) -> list[str]:
    """Stages this worker build cannot run yet, as "name (role)"."""
    return [f"{s.name} ({s.role.value})" for s in stages if s.role not in IMPLEMENTED_ROLES]


def stage_class(spec: ResolvedStage) -> type[Stage]:
    from omnipipe.worker.stages import qwen_image, qwen_omni

    classes: dict[Role, type[Stage]] = {
        Role.TEXT_ENCODER: qwen_image.TextEncodeStage,
        Role.DENOISER: qwen_image.DenoiseStage,
        Role.VAE_DECODER: qwen_image.DecodeStage,
        Role.THINKER: qwen_omni.ThinkerStage,
        Role.TALKER: qwen_omni.TalkerStage,
        Role.CODE2WAV: qwen_omni.Code2WavStage,
    }
    if spec.role not in classes:
        raise NotImplementedError(f"stage role {spec.role} is not implemented by this worker yet")
    return classes[spec.role]
