"""The last stage of a split image pipeline: the denoiser's latents through the pipeline's
VAE to images in the format the client asked for. A family says how its latents become
what its VAE decodes; the batching, the cancel and the format are here.

Requests of one size share the VAE's forwards, up to MAX_FORWARD_PIXELS a forward: a
small image's decode is mostly the forward's own overhead (tiny://qwen-image's VAE at
128x128 on one CPU thread: 38 ms for one image, 91 ms for four), while a 2048x2048
image's activations are gigabytes and go through alone."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from omnipipe.stagekit.image_output import encoded_image
from omnipipe.stagekit.params import int_param
from omnipipe.stagekit.stage import Stage, StageJob, StageResult

# The pixels one VAE forward decodes at most (a megapixel: four 512x512 images, one
# 1024x1024); an image larger than that still goes, alone.
MAX_FORWARD_PIXELS = 1024 * 1024


class ImageDecodeStage(Stage):
    """Latents -> VAE decode -> images, base64. load() sets `pipe` (a diffusers pipeline
    with its `vae` and `image_processor`)."""

    pipe: Any

    @abstractmethod
    def vae_latents(self, job: StageJob) -> torch.Tensor:
        """The job's latents as its VAE decodes them (unpacked, unscaled), on the device
        in the VAE's dtype, one row an image; run under inference mode."""

    def decoded(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows' pixels from the VAE (a video-shaped VAE's frame picked here)."""
        result: torch.Tensor = self.pipe.vae.decode(rows, return_dict=False)[0]
        return result

    def batch_key(self, job: StageJob) -> Hashable | None:
        # The size fixes the latents' shape: requests of one size decode together.
        params = job.params
        return ("decode", str(params.get("width")), str(params.get("height")))

    def decode_batch(self, jobs: Sequence[StageJob], output_type: str) -> list[list[Any] | None]:
        """Each job's images, its rows decoded in forwards shared with the other jobs'
        (all of one size) of at most MAX_FORWARD_PIXELS; None: cancelled. A cancel or
        the watchdog sees the engine between forwards."""
        with torch.inference_mode():
            rows = [
                (j, one)
                for j, job in enumerate(jobs)
                for one in torch.split(self.vae_latents(job), 1)
            ]
        params = jobs[0].params
        pixels = int_param(params, "width", 1024) * int_param(params, "height", 1024)
        per_forward = max(1, MAX_FORWARD_PIXELS // max(1, pixels))
        images: list[list[Any]] = [[] for _ in jobs]
        for start in range(0, len(rows), per_forward):
            chunk = rows[start : start + per_forward]
            live = [(j, one) for j, one in chunk if not jobs[j].cancelled.is_set()]
            if not live:
                continue
            with torch.inference_mode():
                decoded = self.decoded(torch.cat([one for _, one in live]))
                made = self.pipe.image_processor.postprocess(decoded, output_type=output_type)
            for (j, _), image in zip(live, made, strict=True):
                images[j].append(image)
            self.progress()
        return [
            None if job.cancelled.is_set() else mine for job, mine in zip(jobs, images, strict=True)
        ]

    def images(self, job: StageJob, output_type: str) -> list[Any] | None:
        """The job's images alone; None: cancelled."""
        return self.decode_batch([job], output_type)[0]

    def pixels(self, job: StageJob) -> np.ndarray:
        """The images as the pipeline's output_type="np" gives them: (n, H, W, 3) in 0-1."""
        images = self.images(job, "np")
        assert images is not None
        return np.stack(images)

    def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
        return [
            StageResult()
            if images is None
            else StageResult(outputs=[encoded_image(image, job.params) for image in images])
            for job, images in zip(jobs, self.decode_batch(jobs, "pil"), strict=True)
        ]

    def run(self, job: StageJob) -> StageResult:
        return self.run_batch([job])[0]
