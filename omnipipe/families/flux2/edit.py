"""FLUX.2's reference images, as Flux2Pipeline.__call__ and Flux2KleinPipeline.__call__
prepare their `image=`: each checked as the pipeline checks it (at least 64 pixels a
side, at most 8:1), brought down to a megapixel where larger, its sides cropped to the
VAE's multiple, through the VAE (the distribution's mode, patched 2x2, the latent batch
norm applied), packed, and given positions of its own: time 10 for the first, 20 for the
second, and so on. The denoiser runs these tokens after the noise's at every step
(denoise.py)."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from omnipipe.families.flux2 import DEV_MAX_IMAGES, KLEIN_MAX_IMAGES
from omnipipe.families.flux2.loading import DEV, load_flux2
from omnipipe.stagekit.media import decode_image
from omnipipe.stagekit.stage import Stage, StageInputError, StageJob, StageResult
from omnipipe.stagekit.usage import input_image_tokens

# The pipelines' cap on a reference image's pixels.
REFERENCE_PIXELS = 1024 * 1024


def most_images(pipe: Any) -> tuple[str, int]:
    """The checkpoint's name in messages and how many reference images it takes."""
    if type(pipe).__name__ == DEV:
        return "FLUX.2 dev", DEV_MAX_IMAGES
    return "FLUX.2 klein", KLEIN_MAX_IMAGES


def reference_images(pipe: Any, params: dict[str, Any]) -> list[Image.Image]:
    """The request's reference images, as many as the checkpoint takes, each one the
    pipeline would take."""
    images = params.get("images")
    if not isinstance(images, list) or not images:
        raise StageInputError("image: a reference image is required", "image")
    model, most = most_images(pipe)
    if len(images) > most:
        raise StageInputError(
            f"image: {model} edits with at most {most} reference images, got {len(images)}",
            "image",
        )
    decoded = []
    for i, data in enumerate(images):
        where = "image" if len(images) == 1 else f"image[{i}]"
        image = decode_image(data, where)
        try:
            pipe.image_processor.check_image_input(image)
        except ValueError as exc:
            raise StageInputError(f"{where}: {exc}", where) from None
        decoded.append(image)
    return decoded


def reference_pixels(pipe: Any, image: Image.Image) -> torch.Tensor:
    """(1, 3, h, w) in [-1, 1], as the pipelines' step 4 ("process images") makes it."""
    processor = pipe.image_processor
    if image.width * image.height > REFERENCE_PIXELS:
        image = processor._resize_to_target_area(image, REFERENCE_PIXELS)
    multiple = pipe.vae_scale_factor * 2
    width, height = image.width // multiple * multiple, image.height // multiple * multiple
    pixels: torch.Tensor = processor.preprocess(
        image, height=height, width=width, resize_mode="crop"
    )
    return pixels


class Flux2ReferenceEncodeStage(Stage):
    """Reference images -> their packed latents, joined in order, and their positions."""

    def load(self) -> None:
        self.pipe = load_flux2(self.model_path, self.device, {"vae"})

    def run(self, job: StageJob) -> StageResult:
        pipe = self.pipe
        pixels = [reference_pixels(pipe, image) for image in reference_images(pipe, job.params)]
        with torch.inference_mode():
            latents, ids = pipe.prepare_image_latents(
                images=pixels,
                batch_size=1,
                generator=None,
                device=self.device,
                dtype=pipe.vae.dtype,
            )
        return StageResult(
            tensors={"image_latents": latents, "image_ids": ids[0]},
            usage=input_image_tokens(latents),
        )
