"""FLUX.1 text to image (diffusers' pipelines/flux): the CLIP and T5 text encoders, the
FLUX DiT with its distilled guidance (dev) or none (schnell), and the VAE."""

from omnipipe.api.families import Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

STAGES = "omnipipe.families.flux.stages"
DENOISE = "omnipipe.families.flux.denoise"

FAMILY = Family(
    name="flux",
    description="FLUX.1 dev and schnell text to image (diffusers).",
    pipelines=(
        PipelineType(
            name="flux",
            description=(
                "Text to image: CLIP and T5 encoders -> FLUX DiT denoiser (guidance "
                "distilled into the model, no CFG) -> VAE."
            ),
            example_models=(
                "black-forest-labs/FLUX.1-dev",
                "black-forest-labs/FLUX.1-schnell",
                "tiny://flux1-dev",
            ),
            checkpoints=("FluxPipeline",),
            stages=(
                StageDefaults("encode", Role.TEXT_ENCODER, Engine.TRANSFORMERS),
                StageDefaults("denoise", Role.DENOISER, Engine.DIFFUSERS, inputs=("encode",)),
                StageDefaults("decode", Role.VAE_DECODER, Engine.DIFFUSERS, inputs=("denoise",)),
            ),
            stage_classes={
                (Role.TEXT_ENCODER, Engine.TRANSFORMERS): f"{STAGES}:FluxEncodeStage",
                (Role.DENOISER, Engine.DIFFUSERS): f"{DENOISE}:FluxDenoiseStage",
                (Role.VAE_DECODER, Engine.DIFFUSERS): f"{STAGES}:FluxDecodeStage",
            },
        ),
    ),
    tiny_models={
        "flux1-dev": "omnipipe.families.flux.tiny:build_flux1_dev",
        "flux1-schnell": "omnipipe.families.flux.tiny:build_flux1_schnell",
        # A LoRA adapter of tiny://flux1-dev's DiT, for spec.adapters[].source.
        "flux1-dev-lora": "omnipipe.families.flux.tiny_lora:build_flux1_dev_lora",
    },
    requests="omnipipe.families.flux.requests:EXTENSIONS",
)
