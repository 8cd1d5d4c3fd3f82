"""Wan's diffusers loading: only the pipeline components a stage needs."""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)
WAN = "WanPipeline"


def check_checkpoint(model_path: str) -> dict[str, Any]:
    """The checkpoint's model_index.json, refused unless it is a Wan 2.1 text-to-video
    pipeline. Wan 2.2's checkpoints are said not to run yet, rather than served wrong:
    A14B's second, low-noise DiT, and TI2V-5B's per-token timesteps (expand_timesteps)
    over a VAE of 16x, not 8x."""
    from diffusers import DiffusionPipeline

    index = dict(DiffusionPipeline.load_config(model_path))
    if index.get("_class_name") != WAN:
        raise ValueError(
            f"{model_path}: pipeline class {index.get('_class_name')!r} is not one this "
            f"worker runs as Wan; supported: {WAN}"
        )
    if (index.get("transformer_2") or [None])[0] is not None:
        raise NotImplementedError(
            f"{model_path}: a Wan 2.2 checkpoint with two DiTs (transformer_2, the "
            "low-noise expert) is not supported yet; Wan 2.1 is"
        )
    if index.get("expand_timesteps"):
        raise NotImplementedError(
            f"{model_path}: a Wan 2.2 TI2V checkpoint (expand_timesteps) is not supported "
            "yet; Wan 2.1 is"
        )
    return index


def load_wan(model_path: str, device: torch.device, keep: set[str]) -> Any:
    """The checkpoint's WanPipeline with only `keep` loaded; the rest are None, so a stage
    never holds weights it does not run (the real UMT5 encoder alone is 5B)."""
    from diffusers import AutoencoderKLWan, WanPipeline

    index = check_checkpoint(model_path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    given: dict[str, Any] = {c: None for c in index if not c.startswith("_") and c not in keep}
    if "vae" in keep:
        # The VAE runs in float32, as diffusers' Wan examples load it: bf16 decodes band.
        given["vae"] = AutoencoderKLWan.from_pretrained(
            model_path, subfolder="vae", torch_dtype=torch.float32
        )
    log.info("loading %s (%s) components %s on %s", model_path, WAN, sorted(keep), device)
    pipe = WanPipeline.from_pretrained(model_path, dtype=dtype, **given)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    if "vae" not in keep:
        # Latent geometry still depends on the VAE; read it from its config alone.
        config = AutoencoderKLWan.load_config(model_path, subfolder="vae")
        pipe.vae_scale_factor_temporal = config.get("scale_factor_temporal", 4)
        pipe.vae_scale_factor_spatial = config.get("scale_factor_spatial", 8)
    return pipe


def geometry_limits(pipe: Any) -> tuple[int, int]:
    """The largest side (pixels) and frame count this checkpoint's DiT can place: its rotary
    positions reach rope_max_seq_len patches along each axis, a patch being patch_size
    latents, a latent vae_scale_factor pixels (or frames, the first frame alone)."""
    config = pipe.transformer.config
    reach = int(config.rope_max_seq_len)
    patch_t, patch_h, patch_w = (int(p) for p in config.patch_size)
    side = reach * min(patch_h, patch_w) * int(pipe.vae_scale_factor_spatial)
    frames = (reach * patch_t - 1) * int(pipe.vae_scale_factor_temporal) + 1
    return side, frames
