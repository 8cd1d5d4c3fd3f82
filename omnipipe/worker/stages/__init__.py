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
        (Role.VAE_ENCODER, Engine.DIFFUSERS),
        (Role.THINKER, Engine.TRANSFORMERS),
        (Role.THINKER, Engine.VLLM),
        (Role.TALKER, Engine.TRANSFORMERS),
        (Role.CODE2WAV, Engine.TRANSFORMERS),
    }
)


def unimplemented_stages(pipeline: ResolvedPipeline) -> list[str]:
    """Stages this worker build cannot run yet, as "name (role on engine)"."""
    return [
        f"{s.name} ({s.role.value} on {s.engine.value})"
        for s in pipeline.stages
        if (s.role, s.engine) not in IMPLEMENTED
    ]


def image_stage_class(spec: ResolvedStage, model_path: str) -> type[Stage]:
    """The checkpoint's pipeline class picks the family: Qwen-Image or Qwen-Image-Edit."""
    from omnipipe.worker.engines.diffusers import QWEN_IMAGE_EDIT, pipeline_class_name
    from omnipipe.worker.stages import qwen_image, qwen_image_denoise, qwen_image_edit

    if pipeline_class_name(model_path) == QWEN_IMAGE_EDIT:
        return {
            Role.TEXT_ENCODER: qwen_image_edit.EditTextEncodeStage,
            Role.VAE_ENCODER: qwen_image_edit.ImageEncodeStage,
            Role.DENOISER: qwen_image_edit.EditDenoiseStage,
            Role.VAE_DECODER: qwen_image.DecodeStage,
        }[spec.role]
    if spec.role is Role.VAE_ENCODER:
        raise NotImplementedError(
            f"stage {spec.name}: a {QWEN_IMAGE_EDIT} checkpoint is needed for role "
            f"{spec.role.value}; {model_path} is not one"
        )
    return {
        Role.TEXT_ENCODER: qwen_image.TextEncodeStage,
        Role.DENOISER: qwen_image_denoise.SteppedDenoiseStage,
        Role.VAE_DECODER: qwen_image.DecodeStage,
    }[spec.role]


def bagel_stage_class(spec: ResolvedStage, model_path: str) -> type[Stage]:
    from omnipipe.worker.stages.bagel_image import BagelDecodeStage, BagelGenerateStage
    from omnipipe.worker.stages.bagel_think import BagelThinkStage

    classes: dict[tuple[Role, Engine], type[Stage]] = {
        (Role.THINKER, Engine.VLLM): BagelThinkStage,
        (Role.DENOISER, Engine.DIFFUSERS): BagelGenerateStage,
        (Role.VAE_DECODER, Engine.DIFFUSERS): BagelDecodeStage,
    }
    found = classes.get((spec.role, spec.engine))
    if found is None:
        raise NotImplementedError(
            f"stage {spec.name}: a BAGEL checkpoint ({model_path}) runs roles thinker on "
            f"vllm, denoiser and vae-decoder on diffusers, not {spec.role.value} on "
            f"{spec.engine.value}"
        )
    return found


OMNI_ROLES = frozenset({Role.THINKER, Role.TALKER, Role.CODE2WAV})


def stage_class(spec: ResolvedStage, model_path: str) -> type[Stage]:
    """The class that runs the stage; for omni roles the checkpoint's model type picks the
    family (Qwen2.5-Omni or Qwen3-Omni), whatever the pipeline type is called."""
    if (spec.role, spec.engine) not in IMPLEMENTED:
        raise NotImplementedError(
            f"stage {spec.name}: role {spec.role.value} on engine {spec.engine.value} is not "
            "implemented by this worker"
        )
    from omnipipe.worker.bagel.config import is_bagel

    if is_bagel(model_path):
        return bagel_stage_class(spec, model_path)
    if spec.role not in OMNI_ROLES:
        return image_stage_class(spec, model_path)
    if spec.engine is Engine.VLLM:
        from omnipipe.worker.stages.vllm_thinker import vllm_thinker_class

        return vllm_thinker_class(model_path)
    from omnipipe.worker.engines.omni import QWEN3_OMNI, omni_model_type
    from omnipipe.worker.stages import qwen3_omni, qwen_omni, thinker

    if omni_model_type(model_path) == QWEN3_OMNI:
        return {
            Role.THINKER: qwen3_omni.Qwen3ThinkerStage,
            Role.TALKER: qwen3_omni.Qwen3TalkerStage,
            Role.CODE2WAV: qwen3_omni.Qwen3Code2WavStage,
        }[spec.role]
    return {
        Role.THINKER: thinker.ThinkerStage,
        Role.TALKER: qwen_omni.TalkerStage,
        Role.CODE2WAV: qwen_omni.Code2WavStage,
    }[spec.role]
