"""FLUX.2 dev and klein text to image (diffusers' pipelines/flux2): dev's Mistral Small
3.1 encoder and guidance-distilled DiT, klein's Qwen3 encoder and true CFG (none when
step-distilled), one Flux2 DiT class and the Flux2 VAE for both."""

from omnipipe.api.families import Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

STAGES = "omnipipe.families.flux2.stages"
DENOISE = "omnipipe.families.flux2.denoise"
GRAPH = (
    StageDefaults("encode", Role.TEXT_ENCODER, Engine.TRANSFORMERS),
    StageDefaults("denoise", Role.DENOISER, Engine.DIFFUSERS, inputs=("encode",)),
    StageDefaults("decode", Role.VAE_DECODER, Engine.DIFFUSERS, inputs=("denoise",)),
)
STAGE_CLASSES = {
    (Role.TEXT_ENCODER, Engine.TRANSFORMERS): f"{STAGES}:Flux2EncodeStage",
    (Role.DENOISER, Engine.DIFFUSERS): f"{DENOISE}:Flux2DenoiseStage",
    (Role.VAE_DECODER, Engine.DIFFUSERS): f"{STAGES}:Flux2DecodeStage",
}

FAMILY = Family(
    name="flux2",
    description="FLUX.2 dev and klein text to image (diffusers).",
    pipelines=(
        PipelineType(
            name="flux2",
            description=(
                "Text to image: Mistral Small 3.1 encoder -> FLUX.2 DiT denoiser (guidance "
                "distilled into the model, no CFG) -> FLUX.2 VAE."
            ),
            example_models=("black-forest-labs/FLUX.2-dev", "tiny://flux2-dev"),
            checkpoints=("Flux2Pipeline",),
            stages=GRAPH,
            stage_classes=STAGE_CLASSES,
        ),
        PipelineType(
            name="flux2-klein",
            description=(
                "Text to image: Qwen3 encoder (and the negative prompt, under CFG) -> FLUX.2 "
                "DiT denoiser (true CFG in one forward; none when step-distilled) -> "
                "FLUX.2 VAE."
            ),
            example_models=(
                "black-forest-labs/FLUX.2-klein-4B",
                "black-forest-labs/FLUX.2-klein-base-9B",
                "tiny://flux2-klein",
                "tiny://flux2-klein-base",
            ),
            checkpoints=("Flux2KleinPipeline",),
            stages=GRAPH,
            stage_classes=STAGE_CLASSES,
        ),
    ),
    tiny_models={
        "flux2-dev": "omnipipe.families.flux2.tiny:build_flux2_dev",
        "flux2-klein": "omnipipe.families.flux2.tiny:build_flux2_klein",
        "flux2-klein-base": "omnipipe.families.flux2.tiny:build_flux2_klein_base",
        # A LoRA adapter of tiny://flux2-dev's DiT, for spec.adapters[].source.
        "flux2-dev-lora": "omnipipe.families.flux2.tiny_lora:build_flux2_dev_lora",
    },
    requests="omnipipe.families.flux2.requests:EXTENSIONS",
)
