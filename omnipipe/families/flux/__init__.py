"""FLUX.1 text to image and Kontext image editing (diffusers' pipelines/flux): the CLIP
and T5 text encoders, the FLUX DiT with its distilled guidance (dev, Kontext) or none
(schnell), and the VAE (Kontext's encodes the input image too)."""

from omnipipe.api.families import EDIT_STAGES, Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

STAGES = "omnipipe.families.flux.stages"
DENOISE = "omnipipe.families.flux.denoise"
KONTEXT = "omnipipe.families.flux.kontext"

FAMILY = Family(
    name="flux",
    description="FLUX.1 dev and schnell text to image, and Kontext image editing (diffusers).",
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
        PipelineType(
            name="flux-kontext",
            description=(
                "Image editing: CLIP and T5 encoders (the edit prompt) and VAE encoder (the "
                "input image, at its nearest trained size) -> FLUX DiT denoiser (the "
                "image's tokens after the noise's, guidance distilled) -> VAE; a mask keeps the "
                "input outside it (FluxKontextInpaintPipeline)."
            ),
            example_models=("black-forest-labs/FLUX.1-Kontext-dev", "tiny://flux1-kontext"),
            checkpoints=("FluxKontextPipeline",),
            # CLIP and T5 read the prompt alone: the input image goes to the VAE.
            edit_image_roles=frozenset({Role.VAE_ENCODER}),
            # A masked edit: diffusers' FluxKontextInpaintPipeline (inpaint.py).
            takes_mask=True,
            stages=EDIT_STAGES,
            stage_classes={
                (Role.TEXT_ENCODER, Engine.TRANSFORMERS): f"{STAGES}:FluxEncodeStage",
                (Role.VAE_ENCODER, Engine.DIFFUSERS): f"{KONTEXT}:KontextImageEncodeStage",
                (Role.DENOISER, Engine.DIFFUSERS): f"{DENOISE}:FluxDenoiseStage",
                (Role.VAE_DECODER, Engine.DIFFUSERS): f"{STAGES}:FluxDecodeStage",
            },
        ),
    ),
    tiny_models={
        "flux1-dev": "omnipipe.families.flux.tiny:build_flux1_dev",
        "flux1-schnell": "omnipipe.families.flux.tiny:build_flux1_schnell",
        "flux1-kontext": "omnipipe.families.flux.tiny:build_flux1_kontext",
        # A LoRA adapter of tiny://flux1-dev's DiT, for spec.adapters[].source.
        "flux1-dev-lora": "omnipipe.families.flux.tiny_lora:build_flux1_dev_lora",
    },
    requests="omnipipe.families.flux.requests:EXTENSIONS",
)
