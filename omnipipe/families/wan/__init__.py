"""Wan 2.x text to video (diffusers' pipelines/wan): the UMT5 text encoder, the Wan DiT
with true CFG, and the Wan VAE, which writes the frames as an MP4."""

from omnipipe.api.families import Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

STAGES = "omnipipe.families.wan.stages"

FAMILY = Family(
    name="wan",
    description="Wan 2.x text to video (diffusers), served at /v1/videos.",
    pipelines=(
        PipelineType(
            name="wan",
            description="Text to video: UMT5 encoder -> Wan DiT denoiser (true CFG) -> VAE, MP4.",
            example_models=("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "tiny://wan"),
            checkpoints=("WanPipeline",),
            stages=(
                StageDefaults("encode", Role.TEXT_ENCODER, Engine.TRANSFORMERS),
                StageDefaults("denoise", Role.DENOISER, Engine.DIFFUSERS, inputs=("encode",)),
                StageDefaults("decode", Role.VAE_DECODER, Engine.DIFFUSERS, inputs=("denoise",)),
            ),
            makes_video=True,
            stage_classes={
                (Role.TEXT_ENCODER, Engine.TRANSFORMERS): f"{STAGES}:WanEncodeStage",
                (Role.DENOISER, Engine.DIFFUSERS): "omnipipe.families.wan.denoise:WanDenoiseStage",
                (Role.VAE_DECODER, Engine.DIFFUSERS): f"{STAGES}:WanDecodeStage",
            },
        ),
    ),
    tiny_models={"wan": "omnipipe.families.wan.tiny:build_wan"},
    requests="omnipipe.families.wan.requests:EXTENSIONS",
)
