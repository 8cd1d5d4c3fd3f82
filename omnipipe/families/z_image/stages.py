"""Z-Image split into three stages, reproducing ZImagePipeline.__call__: encode (the
Qwen3 encoder's second-to-last hidden state of the chat-templated prompt, its padding
dropped, and under CFG the negative prompt's) -> denoise (denoise.py) -> decode."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.families.z_image.loading import load_z_image
from omnipipe.stagekit.image_decode import ImageDecodeStage
from omnipipe.stagekit.params import float_param, int_param, prompt_of
from omnipipe.stagekit.stage import Stage, StageInputError, StageJob, StageResult
from omnipipe.stagekit.usage import prompt_tokens

# ZImagePipeline's default and its most: the prompt is cut at this many tokens.
MAX_SEQUENCE_LENGTH = 512
# ZImagePipeline.__call__'s guidance_scale: CFG runs above 0 (do_classifier_free_guidance).
DEFAULT_GUIDANCE = 5.0


def guided(params: dict[str, Any]) -> bool:
    """Whether the request runs CFG, as ZImagePipeline decides: any guidance above 0."""
    return float_param(params, "guidance_scale", DEFAULT_GUIDANCE) > 0


class ZImageEncodeStage(Stage):
    """Prompt -> its caption embeddings (length, dim), as long as the prompt's tokens;
    under CFG the negative prompt's too (empty when none was sent, as in the pipeline)."""

    def load(self) -> None:
        self.pipe = load_z_image(self.model_path, self.device, {"text_encoder", "tokenizer"})

    def text_tokenizer(self) -> Any:
        return self.pipe.tokenizer

    def _embeds(self, text: str) -> torch.Tensor:
        with torch.inference_mode():
            [embeds] = self.pipe._encode_prompt(
                [text], device=self.device, max_sequence_length=MAX_SEQUENCE_LENGTH
            )
        result: torch.Tensor = embeds
        return result

    def run(self, job: StageJob) -> StageResult:
        prompt = prompt_of(job.params)
        negative = job.params.get("negative_prompt") or ""
        if not isinstance(negative, str):
            raise StageInputError("negative_prompt must be a string")
        tensors = {"prompt_embeds": self._embeds(prompt)}
        if guided(job.params):
            tensors["negative_prompt_embeds"] = self._embeds(negative)
        elif negative:
            # Without CFG the pipeline ignores it: refused rather than silently dropped.
            raise StageInputError(
                "negative_prompt: Z-Image uses it only under CFG, with guidance_scale above 0"
            )
        texts = [prompt, negative] if guided(job.params) else [prompt]
        counted = prompt_tokens(self.pipe.tokenizer, texts, MAX_SEQUENCE_LENGTH)
        return StageResult(tensors=tensors, usage=counted)


class ZImageDecodeStage(ImageDecodeStage):
    """Latents -> VAE decode -> images in the requested format, base64."""

    def load(self) -> None:
        self.pipe = load_z_image(self.model_path, self.device, {"vae"})

    def vae_latents(self, job: StageJob) -> torch.Tensor:
        vae = self.pipe.vae
        latents = job.inputs["denoise"]["latents"].to(self.device, vae.dtype)
        scaled: torch.Tensor = latents / vae.config.scaling_factor + vae.config.shift_factor
        return scaled


def size_of(params: dict[str, Any]) -> tuple[int, int]:
    return int_param(params, "width", 1024), int_param(params, "height", 1024)
