"""A masked FLUX.1 Kontext edit, as diffusers' FluxKontextInpaintPipeline makes one at
its default strength 1.0 with no `image_reference`: the input image is both Kontext's
conditioning tokens and what the unmasked area keeps. The output is made at the input's
trained size; after each step the denoiser puts back, outside the mask, the input's
latents noised to the next step's sigma with the request's own starting noise (the input
itself after the last step).

The image-encode stage (kontext.py) turns the client's mask into the mask on the latent
grid (`latent_mask`); the denoiser (denoise.py) packs it and blends each of its rows
(`MaskedBlend`), so that masked and unmasked edits share a forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image


def latent_mask(pipe: Any, mask: Image.Image, width: int, height: int) -> torch.Tensor:
    """diffusers' mask_image (white: repaint) on the latent grid of a width x height edit,
    (1, 1, rows, columns) in 0 and 1, as FluxKontextInpaintPipeline prepares it: its
    mask_processor resizes, greys and binarizes it at the image's size, then
    prepare_mask_latents takes the nearest value at each latent."""
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(
        vae_scale_factor=pipe.vae_scale_factor * 2,
        vae_latent_channels=pipe.vae.config.latent_channels,
        do_normalize=False,
        do_binarize=True,
        do_convert_grayscale=True,
    )
    pixels = processor.preprocess(mask, height=height, width=width)
    grid = (2 * (height // (pipe.vae_scale_factor * 2)), 2 * (width // (pipe.vae_scale_factor * 2)))
    grid_mask: torch.Tensor = torch.nn.functional.interpolate(pixels, size=grid)
    return grid_mask


def pack_mask(mask: torch.Tensor, channels: int) -> torch.Tensor:
    """The latent-grid mask packed as FLUX packs its latents, every channel alike:
    (1, tokens, channels * 4), as prepare_mask_latents packs it."""
    from diffusers import FluxPipeline

    _, _, rows, columns = mask.shape
    packed: torch.Tensor = FluxPipeline._pack_latents(
        mask.repeat(1, channels, 1, 1), 1, channels, rows, columns
    )
    return packed


@dataclass
class MaskedBlend:
    """One request's mask (packed, 1 where the edit repaints), its input's packed latents
    and its starting noise, each (n, tokens, channels)."""

    mask: torch.Tensor
    image: torch.Tensor
    noise: torch.Tensor

    def start(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The first latents: the input noised to the first sigma (the scheduler's
        scale_noise; at strength 1 the first sigma is 1, and this is the noise)."""
        return self.noised(sigmas[0])

    def noised(self, sigma: torch.Tensor) -> torch.Tensor:
        sigma = sigma.to(self.image.dtype)
        noised: torch.Tensor = sigma * self.noise + (1.0 - sigma) * self.image
        return noised

    def keep(self, latents: torch.Tensor, sigmas: torch.Tensor, index: int) -> torch.Tensor:
        """The latents after step `index` with the unmasked area put back: the input at
        the next step's sigma, or the input itself after the last step."""
        last = index == len(sigmas) - 2
        proper = self.image if last else self.noised(sigmas[index + 1])
        kept: torch.Tensor = (1 - self.mask) * proper + self.mask * latents
        return kept
