"""AutoencoderKLWan.decode(z), one latent frame at a time.

diffusers' decode() runs the causal decoder frame by frame and concatenates every piece
into one float32 video as it goes, copying it anew for each piece: at the API's largest
video that is about 18 GB, held twice. This runs the same loop and gives each piece as
it is made. It reads diffusers' private decoder state (`clear_cache`, `_feat_map`,
`_conv_idx`, the decoder's `first_chunk`, `unpatchify`), checked against diffusers
0.42.1; tests/unit/test_wan.py holds the pieces, together, equal to decode()'s output."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

CHECKED_DIFFUSERS = "0.42.1"


def vae_pieces(vae: Any, z: torch.Tensor) -> Generator[torch.Tensor, None, None]:
    """(1, 3, frames, height, width) in [-1, 1]: the first frame, then 4 a piece. Each
    decoder call runs under inference mode, none across a yield (the caller's code runs
    there). Tiled decoding keeps its own loop, whole."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    if vae.use_tiling:
        with torch.inference_mode():
            whole: torch.Tensor = vae.decode(z, return_dict=False)[0]
        yield whole
        return
    vae.clear_cache()
    try:
        with torch.inference_mode():
            x = vae.post_quant_conv(z)
        for i in range(x.shape[2]):
            with torch.inference_mode():
                vae._conv_idx = [0]
                out = vae.decoder(
                    x[:, :, i : i + 1],
                    feat_cache=vae._feat_map,
                    feat_idx=vae._conv_idx,
                    first_chunk=i == 0,
                )
                if vae.config.patch_size is not None:
                    out = unpatchify(out, patch_size=vae.config.patch_size)
                piece = torch.clamp(out, min=-1.0, max=1.0)
            yield piece
    finally:
        vae.clear_cache()
