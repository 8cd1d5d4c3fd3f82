"""FLUX.2 dev and klein text to image and reference-image editing (diffusers'
pipelines/flux2): dev's Mistral Small 3.1 encoder and guidance-distilled DiT, klein's Qwen3
encoder and true CFG (none when step-distilled), one Flux2 DiT class and the Flux2 VAE for
both. An edit is the same checkpoint under another pipeline type: the VAE encodes each
reference image, whose tokens follow the noise's in the DiT."""

from omnipipe.api.families import EDIT_STAGES, Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

STAGES = "omnipipe.families.flux2.stages"
DENOISE = "omnipipe.families.flux2.denoise"
EDIT = "omnipipe.families.flux2.edit"
# Reference images an edit takes at most: diffusers' pipelines set no bound (each image
# gets its own time position, 10, 20, ...), so these are Black Forest Labs' for the
# models: FLUX.2 "up to 10" (dev), klein "up to 4". The router's limit and the stages'.
DEV_MAX_IMAGES = 10
KLEIN_MAX_IMAGES = 4
GRAPH = (
    StageDefaults("encode", Role.TEXT_ENCODER, Engine.TRANSFORMERS),
    StageDefaults("denoise", Role.DENOISER, Engine.DIFFUSERS, inputs=("encode",)),
    StageDefaults("decode", Role.VAE_DECODER, Engine.DIFFUSERS, inputs=("denoise",)),
)
# One table for text to image and edits: a worker picks it by the checkpoint's own type
# (flux2 or flux2-klein), and an edit runs on the same checkpoint.
STAGE_CLASSES = {
    (Role.TEXT_ENCODER, Engine.TRANSFORMERS): f"{STAGES}:Flux2EncodeStage",
    (Role.VAE_ENCODER, Engine.DIFFUSERS): f"{EDIT}:Flux2ReferenceEncodeStage",
    (Role.DENOISER, Engine.DIFFUSERS): f"{DENOISE}:Flux2DenoiseStage",
    (Role.VAE_DECODER, Engine.DIFFUSERS): f"{STAGES}:Flux2DecodeStage",
}
# The text encoders read the prompt alone (as the pipelines' encode_prompt does): the
# reference images go to the VAE.
EDIT_READERS = frozenset({Role.VAE_ENCODER})
DEV_MODELS = ("black-forest-labs/FLUX.2-dev", "tiny://flux2-dev")
KLEIN_MODELS = (
    "black-forest-labs/FLUX.2-klein-4B",
    "black-forest-labs/FLUX.2-klein-base-9B",
    "tiny://flux2-klein",
    "tiny://flux2-klein-base",
)

FAMILY = Family(
    name="flux2",
    description="FLUX.2 dev and klein text to image and reference-image editing (diffusers).",
    pipelines=(
        PipelineType(
            name="flux2",
            description=(
                "Text to image: Mistral Small 3.1 encoder -> FLUX.2 DiT denoiser (guidance "
                "distilled into the model, no CFG) -> FLUX.2 VAE."
            ),
            example_models=DEV_MODELS,
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
            example_models=KLEIN_MODELS,
            checkpoints=("Flux2KleinPipeline",),
            stages=GRAPH,
            stage_classes=STAGE_CLASSES,
        ),
        PipelineType(
            name="flux2-edit",
            description=(
                f"Image editing with 1 to {DEV_MAX_IMAGES} reference images, on a FLUX.2 dev "
                "checkpoint: Mistral Small 3.1 encoder (the edit prompt) and VAE encoder "
                "(each reference) -> FLUX.2 DiT denoiser (the references' tokens after the "
                "noise's, guidance distilled) -> FLUX.2 VAE."
            ),
            example_models=DEV_MODELS,
            max_edit_images=DEV_MAX_IMAGES,
            edit_image_roles=EDIT_READERS,
            stages=EDIT_STAGES,
            stage_classes=STAGE_CLASSES,
        ),
        PipelineType(
            name="flux2-klein-edit",
            description=(
                f"Image editing with 1 to {KLEIN_MAX_IMAGES} reference images, on a FLUX.2 "
                "klein checkpoint: Qwen3 encoder (the edit prompt, and the negative under "
                "CFG) and VAE encoder (each reference) -> FLUX.2 DiT denoiser (the "
                "references' tokens after the noise's) -> FLUX.2 VAE."
            ),
            example_models=KLEIN_MODELS,
            max_edit_images=KLEIN_MAX_IMAGES,
            edit_image_roles=EDIT_READERS,
            stages=EDIT_STAGES,
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
