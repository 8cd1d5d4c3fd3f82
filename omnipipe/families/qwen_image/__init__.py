"""Qwen-Image, Qwen-Image-Edit and Qwen-Image-Edit-Plus (2509, 2511: several input
images) (diffusers' pipelines/qwenimage): a text or vision-language encoder, a DiT
denoiser with true CFG, and the VAE."""

from omnipipe.api.families import EDIT_STAGES, Family, PipelineType, StageDefaults
from omnipipe.api.roles import Engine, Role

STAGES = "omnipipe.families.qwen_image.stages"
DENOISE = "omnipipe.families.qwen_image.denoise"
EDIT = "omnipipe.families.qwen_image.edit"
# Qwen-Image-Edit-Plus's inputs at most, as Qwen's model cards give them: the router's
# limit and its stages'.
PLUS_MAX_IMAGES = 3
# Qwen-Image-Edit's stage classes, and Qwen-Image-Edit-Plus's: the same, which read the
# checkpoint's pipeline class for how many inputs it takes and at what sizes.
EDIT_CLASSES = {
    (Role.TEXT_ENCODER, Engine.TRANSFORMERS): f"{EDIT}:EditTextEncodeStage",
    (Role.VAE_ENCODER, Engine.DIFFUSERS): f"{EDIT}:ImageEncodeStage",
    (Role.DENOISER, Engine.DIFFUSERS): f"{EDIT}:EditDenoiseStage",
    (Role.VAE_DECODER, Engine.DIFFUSERS): f"{STAGES}:DecodeStage",
}

FAMILY = Family(
    name="qwen-image",
    description="Qwen-Image text to image and Qwen-Image-Edit (and -Edit-Plus) image editing.",
    pipelines=(
        PipelineType(
            name="qwen-image",
            description="Text to image: text encoder (AR) -> DiT denoiser (true CFG) -> VAE.",
            example_models=("Qwen/Qwen-Image", "tiny://qwen-image"),
            checkpoints=("QwenImagePipeline",),
            stages=(
                StageDefaults("encode", Role.TEXT_ENCODER, Engine.TRANSFORMERS),
                StageDefaults("denoise", Role.DENOISER, Engine.DIFFUSERS, inputs=("encode",)),
                StageDefaults("decode", Role.VAE_DECODER, Engine.DIFFUSERS, inputs=("denoise",)),
            ),
            stage_classes={
                (Role.TEXT_ENCODER, Engine.TRANSFORMERS): f"{STAGES}:TextEncodeStage",
                (Role.DENOISER, Engine.DIFFUSERS): f"{DENOISE}:SteppedDenoiseStage",
                (Role.VAE_DECODER, Engine.DIFFUSERS): f"{STAGES}:DecodeStage",
            },
        ),
        PipelineType(
            name="qwen-image-edit",
            description=(
                "Image editing: vision-language encoder (input image and edit prompt) and "
                "VAE encoder (input image) -> DiT denoiser (true CFG) -> VAE."
            ),
            example_models=("Qwen/Qwen-Image-Edit", "tiny://qwen-image-edit"),
            checkpoints=("QwenImageEditPipeline",),
            stages=EDIT_STAGES,
            stage_classes=EDIT_CLASSES,
        ),
        PipelineType(
            name="qwen-image-edit-plus",
            description=(
                "Image editing with one to three input images (Qwen-Image-Edit-2509 and "
                "-2511): vision-language encoder (each input, named, and the edit prompt) and "
                "VAE encoder (each input) -> DiT denoiser (true CFG) -> VAE."
            ),
            example_models=(
                "Qwen/Qwen-Image-Edit-2511",
                "Qwen/Qwen-Image-Edit-2509",
                "tiny://qwen-image-edit-plus",
            ),
            checkpoints=("QwenImageEditPlusPipeline",),
            max_edit_images=PLUS_MAX_IMAGES,
            stages=EDIT_STAGES,
            stage_classes=EDIT_CLASSES,
        ),
    ),
    tiny_models={
        "qwen-image": "omnipipe.families.qwen_image.tiny:build_qwen_image",
        "qwen-image-edit": "omnipipe.families.qwen_image.tiny_edit:build_qwen_image_edit",
        "qwen-image-edit-plus": (
            "omnipipe.families.qwen_image.tiny_edit:build_qwen_image_edit_plus"
        ),
        # LoRA adapters of tiny://qwen-image's DiT, for spec.adapters[].source.
        "qwen-image-lora": "omnipipe.families.qwen_image.tiny_lora:build_lora",
        "qwen-image-lora-2": "omnipipe.families.qwen_image.tiny_lora:build_lora_2",
    },
)
