"""tiny://qwen-image-edit: QwenImageEditPipeline's real classes with tiny random weights.

The transformer and VAE have tiny://qwen-image's shapes; the Qwen2.5-VL text encoder
keeps its vision tower, and a Qwen2VLProcessor (image processor plus the offline byte
tokenizer) feeds it the input image beside the edit prompt. The vision-token ids in the
model config are the tokenizer's, so the encoder finds the image where the processor put
it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from omnipipe.stagekit.tokenizer import save_byte_tokenizer

VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def build_qwen_image_edit(target: Path) -> None:
    build_edit(target, "QwenImageEditPipeline")


def build_qwen_image_edit_plus(target: Path) -> None:
    """tiny://qwen-image-edit-plus: QwenImageEditPlusPipeline (2509, 2511) with the same
    tiny components; the released checkpoints differ from the Edit one in weights and
    pipeline class, not in their components' classes."""
    build_edit(target, "QwenImageEditPlusPipeline")


def build_edit(target: Path, pipeline_class: str) -> None:
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    from omnipipe.families.qwen_image.tiny import (
        tiny_qwen_image_text_encoder,
        tiny_qwen_image_transformer,
        tiny_qwen_image_vae,
    )

    tokenizer = save_byte_tokenizer(target / "tokenizer")
    image_pad, video_pad, vision_start, vision_end = (
        int(str(tokenizer.convert_tokens_to_ids(t))) for t in VISION_TOKENS
    )
    text_encoder = tiny_qwen_image_text_encoder(
        image_token_id=image_pad,
        video_token_id=video_pad,
        vision_start_token_id=vision_start,
        vision_end_token_id=vision_end,
    )
    processor = Qwen2VLProcessor(
        # The edit pipeline hands the encoder the image at about a megapixel; the tiny
        # vision tower sees it as at most 4 merged patches, so the encoder stays fast.
        image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56),
        video_processor=Qwen2VLVideoProcessor(),
        tokenizer=tokenizer,
    )
    pipe = getattr(diffusers, pipeline_class)(
        transformer=tiny_qwen_image_transformer(),
        vae=tiny_qwen_image_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
    )
    cast(Any, pipe).save_pretrained(str(target))
