"""The last stage of a split image pipeline: the denoiser's latents through the pipeline's
VAE, one image at a time, to images in the format the client asked for. A family says how
its latents become what its VAE decodes; the loop, the cancel and the format are here."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np
import torch

from omnipipe.stagekit.image_output import encoded_image
from omnipipe.stagekit.stage import Stage, StageJob, StageResult


class ImageDecodeStage(Stage):
    """Latents -> VAE decode -> images, base64. load() sets `pipe` (a diffusers pipeline
    with its `vae` and `image_processor`)."""

    pipe: Any

    @abstractmethod
    def vae_latents(self, job: StageJob) -> torch.Tensor:
        """The job's latents as its VAE decodes them (unpacked, unscaled), on the device
        in the VAE's dtype, one row an image; run under inference mode."""

    def decoded(self, one: torch.Tensor) -> torch.Tensor:
        """One image's pixels from the VAE (a video-shaped VAE's frame picked here)."""
        result: torch.Tensor = self.pipe.vae.decode(one, return_dict=False)[0]
        return result

    def images(self, job: StageJob, output_type: str) -> list[Any] | None:
        """Each image of the job, decoded one at a time: a 2048x2048 decode's activations
        are held for one image, and a cancel or the watchdog sees the engine between
        images. None: cancelled."""
        with torch.inference_mode():
            latents = self.vae_latents(job)
        images = []
        for one in torch.split(latents, 1):
            if job.cancelled.is_set():
                return None
            with torch.inference_mode():
                pixels = self.decoded(one)
                [image] = self.pipe.image_processor.postprocess(pixels, output_type=output_type)
            images.append(image)
            self.progress()
        return images

    def pixels(self, job: StageJob) -> np.ndarray:
        """The images as the pipeline's output_type="np" gives them: (n, H, W, 3) in 0-1."""
        images = self.images(job, "np")
        assert images is not None
        return np.stack(images)

    def run(self, job: StageJob) -> StageResult:
        images = self.images(job, "pil")
        if images is None:
            return StageResult()
        return StageResult(outputs=[encoded_image(image, job.params) for image in images])
