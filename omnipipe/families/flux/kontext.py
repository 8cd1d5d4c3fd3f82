"""FLUX.1 Kontext's input image, as FluxKontextPipeline.__call__ prepares it: resized to
the trained resolution nearest its aspect ratio (PREFERRED_KONTEXT_RESOLUTIONS), through
the VAE (the distribution's mode, shifted and scaled), packed in 2x2 patches, with the
positions of the noise's tokens but for the first axis, 1. The denoiser runs these
tokens after the noise's at every step (denoise.py). A masked edit's mask comes along, on
the latent grid (inpaint.py)."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.families.flux import requests
from omnipipe.families.flux.inpaint import latent_mask
from omnipipe.families.flux.loading import load_flux
from omnipipe.stagekit.masks import decode_mask
from omnipipe.stagekit.media import decode_image
from omnipipe.stagekit.stage import Stage, StageInputError, StageJob, StageResult
from omnipipe.stagekit.usage import input_image_tokens


def kontext_size(pipe: Any, width: int, height: int) -> tuple[int, int]:
    """The trained resolution nearest the input's aspect ratio, in multiples of 16."""
    return requests.kontext_size(width, height, pipe.vae_scale_factor * 2)


class KontextImageEncodeStage(Stage):
    """Input image (and a masked edit's mask) -> its packed latents and their positions
    (and the mask on the latent grid)."""

    def load(self) -> None:
        self.pipe = load_flux(self.model_path, self.device, {"vae"})

    def run(self, job: StageJob) -> StageResult:
        images = job.params.get("images")
        if not isinstance(images, list) or len(images) != 1:
            count = len(images) if isinstance(images, list) else 0
            raise StageInputError(f"image: FLUX.1 Kontext edits one image, got {count}", "image")
        pipe = self.pipe
        image = decode_image(images[0], "image")
        multiple = pipe.vae_scale_factor * 2
        if min(image.size) < multiple:
            # Its side rounds down to none: diffusers' aspect ratio would divide by zero.
            raise StageInputError(
                f"image: FLUX.1 Kontext edits inputs of at least {multiple} pixels a side, "
                f"got {image.width}x{image.height}",
                "image",
            )
        mask = job.params.get("mask")
        repaint = None if mask is None else decode_mask(mask, image.size)
        # As the pipeline reads the input's size: each side down to the VAE's multiple.
        height, width = pipe.image_processor.get_default_height_width(image)
        width, height = kontext_size(pipe, width, height)
        image = pipe.image_processor.resize(image, height, width)
        pixels = pipe.image_processor.preprocess(image, height, width)
        config = pipe.vae.config
        with torch.inference_mode():
            pixels = pixels.to(self.device, pipe.vae.dtype)
            latents = pipe.vae.encode(pixels).latent_dist.mode()
            latents = (latents - config.shift_factor) * config.scaling_factor
        channels, lat_h, lat_w = latents.shape[1:]
        packed = pipe._pack_latents(latents, 1, channels, lat_h, lat_w)
        ids = pipe._prepare_latent_image_ids(1, lat_h // 2, lat_w // 2, self.device, packed.dtype)
        ids[..., 0] = 1
        tensors = {"image_latents": packed, "image_ids": ids}
        if repaint is not None:
            tensors["mask"] = latent_mask(pipe, repaint, width, height)
        return StageResult(tensors=tensors, usage=input_image_tokens(packed))
