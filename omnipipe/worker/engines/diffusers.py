"""diffusers adapter: load only the pipeline components a stage needs."""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)
QWEN_IMAGE_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")


def load_qwen_image(model_path: str, device: torch.device, keep: set[str]) -> Any:
    """QwenImagePipeline with only `keep` loaded; the rest are None so a stage never
    holds weights it does not run (the text encoder alone is 7B for the real model)."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    skipped = {name: None for name in QWEN_IMAGE_COMPONENTS if name not in keep}
    log.info("loading %s components %s on %s", model_path, sorted(keep), device)
    pipe = QwenImagePipeline.from_pretrained(model_path, dtype=dtype, **skipped)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    if "vae" not in keep:
        # Latent geometry still depends on the VAE; read it from its config alone.
        config = AutoencoderKLQwenImage.load_config(model_path, subfolder="vae")
        pipe.vae_scale_factor = 2 ** len(config["temperal_downsample"])
    return pipe
