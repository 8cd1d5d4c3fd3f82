"""Z-Image and Z-Image-Turbo text to image (diffusers' pipelines/z_image): the Qwen3 text
encoder, the single-stream Z-Image DiT with CFG (the base model) or none (Turbo, run
with guidance_scale 0), and the FLUX-style VAE."""

from omnipipe.api.families import Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

STAGES = "omnipipe.families.z_image.stages"
DENOISE = "omnipipe.families.z_image.denoise"

FAMILY = Family(
    name="z-image",
    description="Z-Image and Z-Image-Turbo text to image (diffusers).",
    pipelines=(
        PipelineType(
            name="z-image",
            description=(
                "Text to image: Qwen3 encoder (the prompt and, under CFG, the negative "
                "prompt) -> single-stream DiT denoiser (CFG above guidance 0; Turbo runs "
                "at 0, without) -> VAE."
            ),
            example_models=("Tongyi-MAI/Z-Image-Turbo", "Tongyi-MAI/Z-Image", "tiny://z-image"),
            checkpoints=("ZImagePipeline",),
            stages=(
                StageDefaults("encode", Role.TEXT_ENCODER, Engine.TRANSFORMERS),
                StageDefaults("denoise", Role.DENOISER, Engine.DIFFUSERS, inputs=("encode",)),
                StageDefaults("decode", Role.VAE_DECODER, Engine.DIFFUSERS, inputs=("denoise",)),
            ),
            stage_classes={
                (Role.TEXT_ENCODER, Engine.TRANSFORMERS): f"{STAGES}:ZImageEncodeStage",
                (Role.DENOISER, Engine.DIFFUSERS): f"{DENOISE}:ZImageDenoiseStage",
                (Role.VAE_DECODER, Engine.DIFFUSERS): f"{STAGES}:ZImageDecodeStage",
            },
        ),
    ),
    tiny_models={
        "z-image": "omnipipe.families.z_image.tiny:build_z_image",
        "z-image-turbo": "omnipipe.families.z_image.tiny:build_z_image_turbo",
        # A LoRA adapter of tiny://z-image's DiT, for spec.adapters[].source.
        "z-image-lora": "omnipipe.families.z_image.tiny_lora:build_z_image_lora",
    },
    requests="omnipipe.families.z_image.requests:EXTENSIONS",
)
