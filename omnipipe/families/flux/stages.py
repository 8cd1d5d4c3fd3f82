"""FLUX.1 split into three stages, reproducing FluxPipeline.__call__: encode (the CLIP
pooled embedding and the T5 sequence) -> denoise (denoise.py) -> decode."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from omnipipe.families.flux.loading import load_flux
from omnipipe.stagekit.image_output import encoded_image
from omnipipe.stagekit.params import int_param, prompt_of
from omnipipe.stagekit.stage import Stage, StageJob, StageResult

# FluxPipeline's default and its most: the T5 sequence is padded to this length.
MAX_SEQUENCE_LENGTH = 512


class FluxEncodeStage(Stage):
    """Prompt -> CLIP's pooled embedding and T5's padded sequence (FLUX has no negative
    prompt: its guidance is distilled)."""

    def load(self) -> None:
        keep = {"text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"}
        self.pipe = load_flux(self.model_path, self.device, keep)

    def text_tokenizer(self) -> Any:
        return self.pipe.tokenizer_2

    def run(self, job: StageJob) -> StageResult:
        prompt = prompt_of(job.params)
        with torch.inference_mode():
            embeds, pooled, _ = self.pipe.encode_prompt(
                prompt=prompt,
                prompt_2=None,
                device=self.device,
                max_sequence_length=MAX_SEQUENCE_LENGTH,
            )
        return StageResult(tensors={"prompt_embeds": embeds, "pooled_prompt_embeds": pooled})


class FluxDecodeStage(Stage):
    """Packed latents -> VAE decode -> images in the requested format, base64."""

    def load(self) -> None:
        self.pipe = load_flux(self.model_path, self.device, {"vae"})

    def _images(self, job: StageJob, output_type: str) -> list[Any] | None:
        """Each image of the job, decoded one at a time (a 2048x2048 decode's activations
        are held for one image, and a cancel is seen between images); None: cancelled."""
        pipe = self.pipe
        width, height = int_param(job.params, "width", 1024), int_param(job.params, "height", 1024)
        latents = job.inputs["denoise"]["latents"].to(self.device)
        with torch.inference_mode():
            latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
            config = pipe.vae.config
            latents = (latents / config.scaling_factor + config.shift_factor).to(pipe.vae.dtype)
        images = []
        for one in latents.split(1):
            if job.cancelled.is_set():
                return None
            with torch.inference_mode():
                decoded = pipe.vae.decode(one, return_dict=False)[0]
                [image] = pipe.image_processor.postprocess(decoded, output_type=output_type)
            images.append(image)
            self.progress()
        return images

    def pixels(self, job: StageJob) -> np.ndarray:
        """The images as FluxPipeline's output_type="np" gives them: (n, H, W, 3) in 0-1."""
        images = self._images(job, "np")
        assert images is not None
        return np.stack(images)

    def run(self, job: StageJob) -> StageResult:
        images = self._images(job, "pil")
        if images is None:
            return StageResult()
        return StageResult(outputs=[encoded_image(image, job.params) for image in images])
