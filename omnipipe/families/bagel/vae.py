"""BAGEL's VAE side: the FLUX autoencoder (diffusers' AutoencoderKL covers it), with the
latent scale and shift in its config, and the p x p patching of latents into tokens."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from PIL import Image

VAE_SUBFOLDER = "vae"
# The released checkpoint's FLUX autoencoder, in its original (not diffusers) layout.
FLUX_AE_FILE = "ae.safetensors"


def load_vae(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    from diffusers import AutoencoderKL

    root = Path(path)
    if (root / VAE_SUBFOLDER).is_dir():
        vae = AutoencoderKL.from_pretrained(str(root), subfolder=VAE_SUBFOLDER)
    else:
        # diffusers converts FLUX's original autoencoder file itself.
        vae = AutoencoderKL.from_single_file(str(root / FLUX_AE_FILE))
    return vae.to(dtype).eval()


def unpatchify(tokens: torch.Tensor, rows: int, cols: int, p: int, channels: int) -> torch.Tensor:
    """(rows*cols, p*p*channels) tokens -> (1, channels, rows*p, cols*p) latents."""
    x = tokens.reshape(1, rows, cols, p, p, channels)
    x = torch.einsum("nhwpqc->nchpwq", x)
    return x.reshape(1, channels, rows * p, cols * p)


def decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Latents -> RGB in [0, 1], (1, 3, H, W)."""
    cfg = vae.config
    z = latents.to(vae.dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
    with torch.inference_mode():
        image: torch.Tensor = vae.decode(z, return_dict=False)[0]
    return (image.float() * 0.5 + 0.5).clamp(0, 1)


def to_image(image: torch.Tensor) -> Image.Image:
    """The first image of a decoded batch (values 0-1) as 8-bit RGB."""
    from PIL import Image

    pixels = (image[0].permute(1, 2, 0) * 255).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(pixels)


def to_png(image: torch.Tensor) -> bytes:
    import io

    buf = io.BytesIO()
    to_image(image).save(buf, format="PNG")
    return buf.getvalue()
