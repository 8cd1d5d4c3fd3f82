"""The stage classes of a Qwen-Image or Qwen-Image-Edit checkpoint, by role: the
checkpoint's pipeline class, not the pipeline type's name, says which it is."""

from __future__ import annotations

from omnipipe.api import ResolvedStage
from omnipipe.api.spec import Role
from omnipipe.families.qwen_image.loading import QWEN_IMAGE_EDIT, pipeline_class_name
from omnipipe.worker.stages.base import Stage


def stage_class(spec: ResolvedStage, model_path: str) -> type[Stage]:
    from omnipipe.families.qwen_image import denoise, edit, stages

    if pipeline_class_name(model_path) == QWEN_IMAGE_EDIT:
        return {
            Role.TEXT_ENCODER: edit.EditTextEncodeStage,
            Role.VAE_ENCODER: edit.ImageEncodeStage,
            Role.DENOISER: edit.EditDenoiseStage,
            Role.VAE_DECODER: stages.DecodeStage,
        }[spec.role]
    if spec.role is Role.VAE_ENCODER:
        raise NotImplementedError(
            f"stage {spec.name}: a {QWEN_IMAGE_EDIT} checkpoint is needed for role "
            f"{spec.role.value}; {model_path} is not one"
        )
    return {
        Role.TEXT_ENCODER: stages.TextEncodeStage,
        Role.DENOISER: denoise.SteppedDenoiseStage,
        Role.VAE_DECODER: stages.DecodeStage,
    }[spec.role]
