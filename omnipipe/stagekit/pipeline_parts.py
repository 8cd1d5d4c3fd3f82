"""A diffusers pipeline with only the components a stage runs: each split family's stages
load their checkpoint's pipeline class with the rest of its components left out (None),
so a stage never holds weights it does not run (a released text encoder alone is 4B to
24B), and keep the pipeline's own methods (encode_prompt, prepare_latents, ...)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)


def vae_downsampling(config: dict[str, Any]) -> int:
    """An image VAE's scale, from its config alone: 2 per down block after the first."""
    return int(2 ** (len(config["block_out_channels"]) - 1))


def pipeline_class_of(model_path: str, classes: Sequence[str]) -> str:
    """The checkpoint's model_index.json `_class_name`, refused unless one of `classes`."""
    from diffusers import DiffusionPipeline

    name = str(DiffusionPipeline.load_config(model_path)["_class_name"])
    if name not in classes:
        raise ValueError(
            f"{model_path}: pipeline class {name!r} is not one this stage runs; "
            f"supported: {', '.join(classes)}"
        )
    return name


def load_pipeline_parts(
    model_path: str,
    device: torch.device,
    keep: set[str],
    classes: Sequence[str],
    vae_scale: Callable[[dict[str, Any]], int] = vae_downsampling,
) -> Any:
    """The checkpoint's pipeline (one of `classes`) with only the components in `keep`
    loaded, in bfloat16 on a GPU and float32 on the CPU. Where the VAE is left out, the
    pipeline's vae_scale_factor (its latent geometry) is set from the VAE's config alone,
    by `vae_scale`."""
    import diffusers
    from diffusers import AutoencoderKL, DiffusionPipeline

    name = pipeline_class_of(model_path, classes)
    index = DiffusionPipeline.load_config(model_path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # A component's entry names its library and class; the others are settings
    # (Flux2KleinPipeline's is_distilled).
    skipped = {
        c: None
        for c, value in index.items()
        if not c.startswith("_") and isinstance(value, list) and c not in keep
    }
    log.info("loading %s (%s) components %s on %s", model_path, name, sorted(keep), device)
    pipe = getattr(diffusers, name).from_pretrained(model_path, dtype=dtype, **skipped)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    if "vae" not in keep:
        # Any VAE class reads vae/config.json; AutoencoderKL's reader is no other's.
        pipe.vae_scale_factor = vae_scale(AutoencoderKL.load_config(model_path, subfolder="vae"))
    return pipe
