"""FLUX.2 split into three stages, reproducing Flux2Pipeline.__call__ and
Flux2KleinPipeline.__call__: encode (the text encoder's hidden states of three layers,
stacked: dev's Mistral with FLUX.2's system message, klein's Qwen3 through its chat
template; klein's negative prompt beside the prompt under CFG) -> denoise (denoise.py)
-> decode (the VAE's latent batch norm undone, the 2x2 patches unpacked, the VAE)."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.families.flux2.loading import DEV, load_flux2, runs_cfg
from omnipipe.stagekit.image_decode import ImageDecodeStage
from omnipipe.stagekit.params import float_param, int_param, prompt_of
from omnipipe.stagekit.stage import Stage, StageInputError, StageJob, StageResult, Tensors
from omnipipe.stagekit.usage import prompt_tokens

# Both pipelines' default and what they pad every prompt to: the DiT sees 512 text tokens.
MAX_SEQUENCE_LENGTH = 512
# Both pipelines' default guidance_scale.
DEFAULT_GUIDANCE = 4.0


def negative_prompt_refusal(pipe: Any) -> str:
    if type(pipe).__name__ == DEV:
        return (
            "negative_prompt: FLUX.2 dev takes no negative prompt: its guidance is distilled "
            f"into the model (guidance_scale, {DEFAULT_GUIDANCE:g} by default)"
        )
    return (
        "negative_prompt: this FLUX.2 klein checkpoint is step-distilled and runs no CFG, so "
        "it takes no negative prompt (the klein base checkpoints do)"
    )


class Flux2EncodeStage(Stage):
    """Prompt -> the text encoder's stacked hidden states, padded to 512 tokens; under
    klein's CFG the negative prompt's too ("" unless the request sent one, as the
    pipeline's)."""

    def load(self) -> None:
        self.pipe = load_flux2(self.model_path, self.device, {"text_encoder", "tokenizer"})
        self.cfg = runs_cfg(self.pipe)

    def text_tokenizer(self) -> Any:
        tokenizer = self.pipe.tokenizer
        # dev's is a PixtralProcessor around the text tokenizer.
        return getattr(tokenizer, "tokenizer", tokenizer)

    def run(self, job: StageJob) -> StageResult:
        prompt = prompt_of(job.params)
        negative = job.params.get("negative_prompt")
        if negative and not self.cfg:
            raise StageInputError(negative_prompt_refusal(self.pipe), "negative_prompt")
        if negative is not None and not isinstance(negative, str):
            raise StageInputError("negative_prompt must be a string", "negative_prompt")
        prompts = [prompt]
        if self.cfg and float_param(job.params, "guidance_scale", DEFAULT_GUIDANCE) > 1:
            prompts.append(negative or "")
        with torch.inference_mode():
            embeds, _ = self.pipe.encode_prompt(
                prompt=prompts, device=self.device, max_sequence_length=MAX_SEQUENCE_LENGTH
            )
        out: Tensors = {"prompt_embeds": embeds[:1]}
        if len(prompts) == 2:
            out["negative_prompt_embeds"] = embeds[1:]
        counted = prompt_tokens(self.text_tokenizer(), prompts, MAX_SEQUENCE_LENGTH)
        return StageResult(tensors=out, usage=counted)


class Flux2DecodeStage(ImageDecodeStage):
    """Packed latents -> the VAE's batch norm undone, unpatchified -> VAE decode ->
    images in the requested format, base64."""

    def load(self) -> None:
        self.pipe = load_flux2(self.model_path, self.device, {"vae"})

    def vae_latents(self, job: StageJob) -> torch.Tensor:
        pipe, vae = self.pipe, self.pipe.vae
        width, height = int_param(job.params, "width", 1024), int_param(job.params, "height", 1024)
        latents = job.inputs["denoise"]["latents"].to(self.device)
        patches = pipe.vae_scale_factor * 2
        grid = torch.zeros(len(latents), 1, height // patches, width // patches)
        ids = pipe._prepare_latent_ids(grid).to(self.device)
        latents = pipe._unpack_latents_with_ids(latents, ids)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        latents = latents * std.to(latents.device, latents.dtype) + mean
        unpatched: torch.Tensor = pipe._unpatchify_latents(latents).to(vae.dtype)
        return unpatched
