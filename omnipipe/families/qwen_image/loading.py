"""Qwen-Image's pipelines, loaded with only the components a stage runs (the text encoder
alone is 7B released)."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.stagekit.pipeline_parts import load_pipeline_parts, pipeline_class_of

QWEN_IMAGE = "QwenImagePipeline"
QWEN_IMAGE_EDIT = "QwenImageEditPipeline"
QWEN_IMAGE_EDIT_PLUS = "QwenImageEditPlusPipeline"  # 2509 and 2511: several input images
PIPELINE_CLASSES = (QWEN_IMAGE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS)


def pipeline_class_name(model_path: str) -> str:
    """The checkpoint's model_index.json `_class_name`: which Qwen-Image family it is."""
    return pipeline_class_of(model_path, PIPELINE_CLASSES)


def vae_scale(config: dict[str, Any]) -> int:
    """Qwen-Image's video-shaped VAE: 2 per temporal-downsample flag (8 released)."""
    return int(2 ** len(config["temperal_downsample"]))


def load_qwen_image(model_path: str, device: torch.device, keep: set[str]) -> Any:
    return load_pipeline_parts(model_path, device, keep, PIPELINE_CLASSES, vae_scale)
