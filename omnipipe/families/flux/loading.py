"""FLUX.1's diffusers loading: only the pipeline components a stage needs."""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)
FLUX = "FluxPipeline"
KONTEXT = "FluxKontextPipeline"  # FLUX.1 Kontext: dev's DiT, editing an input image
PIPELINE_CLASSES = (FLUX, KONTEXT)


def load_flux(model_path: str, device: torch.device, keep: set[str]) -> Any:
    """The checkpoint's pipeline (FluxPipeline or FluxKontextPipeline) with only `keep`
    loaded; the rest are None, so a stage never holds weights it does not run (the T5
    encoder alone is 4.7B released)."""
    import diffusers
    from diffusers import AutoencoderKL, DiffusionPipeline

    name = str(DiffusionPipeline.load_config(model_path)["_class_name"])
    if name not in PIPELINE_CLASSES:
        raise ValueError(
            f"{model_path}: pipeline class {name!r} is not one of {', '.join(PIPELINE_CLASSES)}"
        )
    components = DiffusionPipeline.load_config(model_path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    skipped = {c: None for c in components if not c.startswith("_") and c not in keep}
    log.info("loading %s components %s on %s", model_path, sorted(keep), device)
    pipe = getattr(diffusers, name).from_pretrained(model_path, dtype=dtype, **skipped)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    if "vae" not in keep:
        # Latent geometry still depends on the VAE; read it from its config alone.
        config = AutoencoderKL.load_config(model_path, subfolder="vae")
        pipe.vae_scale_factor = 2 ** (len(config["block_out_channels"]) - 1)
    return pipe
