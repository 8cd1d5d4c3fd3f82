"""Stage implementations by role and engine."""

from __future__ import annotations

from omnipipe.api import ResolvedPipeline, ResolvedStage
from omnipipe.api.spec import Engine, Role
from omnipipe.worker.stages.base import Stage

IMPLEMENTED = frozenset(
    {
        (Role.TEXT_ENCODER, Engine.TRANSFORMERS),
        (Role.DENOISER, Engine.DIFFUSERS),
        (Role.VAE_DECODER, Engine.DIFFUSERS),
        (Role.THINKER, Engine.TRANSFORMERS),
        (Role.TALKER, Engine.TRANSFORMERS),
        (Role.CODE2WAV, Engine.TRANSFORMERS),
    }
)


# Pipeline types whose checkpoints the stage classes cannot load yet: their stages have
# the same roles as implemented ones, so the role alone would not refuse them.
UNSUPPORTED_PIPELINES = frozenset({"qwen3-omni"})


def unimplemented_stages(pipeline: ResolvedPipeline) -> list[str]:
    """Stages this worker build cannot run yet, as "name (role on engine)"."""
    if pipeline.pipeline in UNSUPPORTED_PIPELINES:
        return [f"{s.name} ({pipeline.pipeline} {s.role.value})" for s in pipeline.stages]
    return [
        f"{s.name} ({s.role.value} on {s.engine.value})"
        for s in pipeline.stages
        if (s.role, s.engine) not in IMPLEMENTED
    ]


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
    if (spec.role, spec.engine) not in IMPLEMENTED:
        raise NotImplementedError(
            f"stage {spec.name}: role {spec.role.value} on engine {spec.engine.value} is not "
            "implemented by this worker"
        )
    return classes[spec.role]
