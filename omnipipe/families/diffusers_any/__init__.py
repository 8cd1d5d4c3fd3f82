"""Any diffusers pipeline, run whole as one stage: the path for a model that no family
splits into stages (Stable Diffusion 3, Sana, and the rest of diffusers' catalogue). It
serves a diffusers checkpoint that no other pipeline type claims, and any diffusers
checkpoint whose spec says `pipeline: diffusers`."""

from omnipipe.api.families import Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

FAMILY = Family(
    name="diffusers",
    description="Any diffusers pipeline run whole as one stage (the fallback for a model "
    "with no family).",
    pipelines=(
        PipelineType(
            name="diffusers",
            description=(
                "One stage: the checkpoint's own diffusers pipeline, whole (its encoders, "
                "its denoising loop and its decoder in one process); requests of one size "
                "and settings share its batch."
            ),
            example_models=(
                "stabilityai/stable-diffusion-3.5-medium",
                "Efficient-Large-Model/Sana_1600M_1024px_diffusers",
                "tiny://sd3",
                "tiny://sana",
            ),
            any_diffusers_checkpoint=True,
            stages=(StageDefaults("pipeline", Role.DENOISER, Engine.DIFFUSERS),),
            stage_classes={
                (Role.DENOISER, Engine.DIFFUSERS): (
                    "omnipipe.families.diffusers_any.stage:WholePipelineStage"
                ),
            },
        ),
    ),
    tiny_models={
        "sd3": "omnipipe.families.diffusers_any.tiny:build_sd3",
        "sana": "omnipipe.families.diffusers_any.tiny:build_sana",
    },
    requests="omnipipe.families.diffusers_any.requests:EXTENSIONS",
)
