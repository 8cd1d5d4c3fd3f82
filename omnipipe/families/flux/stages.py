"""FLUX.1 split into three stages, reproducing FluxPipeline.__call__: encode (the CLIP
pooled embedding and the T5 sequence) -> denoise (denoise.py) -> decode."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.families.flux.loading import load_flux
from omnipipe.stagekit.image_decode import ImageDecodeStage
from omnipipe.stagekit.params import int_param, prompt_of
from omnipipe.stagekit.stage import Stage, StageJob, StageResult
from omnipipe.stagekit.usage import prompt_tokens

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
        return StageResult(
            tensors={"prompt_embeds": embeds, "pooled_prompt_embeds": pooled},
            usage=prompt_tokens(self.pipe.tokenizer_2, [prompt], MAX_SEQUENCE_LENGTH),
        )


class FluxDecodeStage(ImageDecodeStage):
    """Packed latents -> VAE decode -> images in the requested format, base64."""

    def load(self) -> None:
        self.pipe = load_flux(self.model_path, self.device, {"vae"})

    def vae_latents(self, job: StageJob) -> torch.Tensor:
        pipe, config = self.pipe, self.pipe.vae.config
        width, height = int_param(job.params, "width", 1024), int_param(job.params, "height", 1024)
        latents = job.inputs["denoise"]["latents"].to(self.device)
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        unscaled: torch.Tensor = latents / config.scaling_factor + config.shift_factor
        return unscaled.to(pipe.vae.dtype)
