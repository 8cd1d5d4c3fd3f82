"""Qwen-Image's diffusers loading: only the pipeline components a stage needs."""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)
QWEN_IMAGE = "QwenImagePipeline"
QWEN_IMAGE_EDIT = "QwenImageEditPipeline"
QWEN_IMAGE_EDIT_PLUS = "QwenImageEditPlusPipeline"  # 2509 and 2511: several input images
PIPELINE_CLASSES = (QWEN_IMAGE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS)


def pipeline_class_name(model_path: str) -> str:
    """The checkpoint's model_index.json `_class_name`: which Qwen-Image family it is."""
    from diffusers import DiffusionPipeline

    name = str(DiffusionPipeline.load_config(model_path)["_class_name"])
    if name not in PIPELINE_CLASSES:
        raise ValueError(
            f"{model_path}: pipeline class {name!r} is not one this worker runs; "
            f"supported: {', '.join(PIPELINE_CLASSES)}"
        )
    return name


def load_qwen_image(model_path: str, device: torch.device, keep: set[str]) -> Any:
    """The checkpoint's pipeline (one of PIPELINE_CLASSES) with only
    `keep` loaded; the rest are None so a stage never holds weights it does not run (the
    text encoder alone is 7B for the real model)."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, DiffusionPipeline

    name = pipeline_class_name(model_path)
    components = DiffusionPipeline.load_config(model_path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    skipped = {c: None for c in components if not c.startswith("_") and c not in keep}
    log.info("loading %s (%s) components %s on %s", model_path, name, sorted(keep), device)
    pipe = getattr(diffusers, name).from_pretrained(model_path, dtype=dtype, **skipped)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    if "vae" not in keep:
        # Latent geometry still depends on the VAE; read it from its config alone.
        config = AutoencoderKLQwenImage.load_config(model_path, subfolder="vae")
        pipe.vae_scale_factor = 2 ** len(config["temperal_downsample"])
    return pipe
