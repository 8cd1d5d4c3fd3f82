"""The tiny image VAE of the FLUX.1 lineage (FLUX.1, Z-Image, Stable Diffusion 3): the
released geometry (8x down, 16 latent channels, no quant convs) at 8 channels a block,
with random weights and the released checkpoint's scale and shift, so that a tiny DiT sees
as many tokens at a size as the released one does."""

from __future__ import annotations

from typing import Any

# FLUX.1's VAE (Z-Image's is the same); Stable Diffusion 3's has its own.
FLUX_SCALE, FLUX_SHIFT = 0.3611, 0.1159


def tiny_image_vae(
    scaling_factor: float = FLUX_SCALE, shift_factor: float = FLUX_SHIFT, **config: Any
) -> Any:
    """An AutoencoderKL of that geometry, seeded; `config`: more of its arguments
    (force_upcast, as a checkpoint's config has it)."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        **config,
    )
