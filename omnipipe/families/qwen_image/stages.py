"""Qwen-Image split into three stages, reproducing QwenImagePipeline.__call__:
encode (prompt and negative prompt in one batch) -> denoise (true CFG,
denoise.py) -> decode."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.families.qwen_image.loading import load_qwen_image
from omnipipe.stagekit.image_decode import ImageDecodeStage
from omnipipe.stagekit.params import int_param, prompt_of
from omnipipe.stagekit.stage import Stage, StageJob, StageResult, Tensors
from omnipipe.stagekit.usage import prompt_tokens

MAX_SEQUENCE_LENGTH = 512


class TextEncodeStage(Stage):
    """Prompt (and negative prompt, for CFG) -> embeddings and masks."""

    def load(self) -> None:
        self.pipe = load_qwen_image(self.model_path, self.device, {"text_encoder", "tokenizer"})

    def text_tokenizer(self) -> Any:
        return self.pipe.tokenizer

    def run(self, job: StageJob) -> StageResult:
        prompt = prompt_of(job.params)
        negative = job.params.get("negative_prompt")
        prompts = [prompt] if not negative else [prompt, str(negative)]
        with torch.inference_mode():
            embeds, mask = self.pipe.encode_prompt(
                prompt=prompts, device=self.device, max_sequence_length=MAX_SEQUENCE_LENGTH
            )
        if mask is None:  # no padding in the batch
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        out: Tensors = {}
        for i, prefix in enumerate(("prompt", "negative_prompt")[: len(prompts)]):
            length = int(mask[i].sum())
            out[f"{prefix}_embeds"] = embeds[i : i + 1, :length]
            out[f"{prefix}_mask"] = mask[i : i + 1, :length]
        counted = prompt_tokens(self.pipe.tokenizer, prompts, MAX_SEQUENCE_LENGTH)
        return StageResult(tensors=out, usage=counted)


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows of [batch, length, ...] stacked along batch, each zero-padded at the end to the
    longest length. The masks pad with 0 too, so attention never sees the padding."""
    longest = max(r.shape[1] for r in rows)
    return torch.cat(
        [
            torch.nn.functional.pad(r, (0, 0) * (r.dim() - 2) + (0, longest - r.shape[1]))
            for r in rows
        ]
    )


def schedule_shift(scheduler_config: Any, image_tokens: int) -> float:
    """The flow-matching schedule's shift (mu) for an image of this many tokens, as
    QwenImagePipeline and QwenImageEditPipeline compute it."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    mu: float = calculate_shift(
        image_tokens,
        scheduler_config.get("base_image_seq_len", 256),
        scheduler_config.get("max_image_seq_len", 4096),
        scheduler_config.get("base_shift", 0.5),
        scheduler_config.get("max_shift", 1.15),
    )
    return mu


def geometry(params: dict[str, Any]) -> tuple[int, int, int, int, float]:
    """Width, height, images, steps and guidance scale of a text-to-image request."""
    width, height = int_param(params, "width", 1024), int_param(params, "height", 1024)
    n, steps = int_param(params, "n", 1), int_param(params, "num_inference_steps", 50)
    guidance = float(params.get("guidance_scale", 4.0))
    return width, height, n, steps, guidance


class DecodeStage(ImageDecodeStage):
    """Latents -> VAE decode -> images in the requested format, base64 for the router."""

    def load(self) -> None:
        self.pipe = load_qwen_image(self.model_path, self.device, {"vae"})

    def vae_latents(self, job: StageJob) -> torch.Tensor:
        pipe = self.pipe
        width, height = int_param(job.params, "width", 1024), int_param(job.params, "height", 1024)
        latents = job.inputs["denoise"]["latents"].to(self.device)
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        latents = latents.to(pipe.vae.dtype)
        z = pipe.vae.config.z_dim
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1)
        std = torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1)
        unscaled: torch.Tensor = latents * std.to(latents) + mean.to(latents)
        return unscaled

    def decoded(self, rows: torch.Tensor) -> torch.Tensor:
        # The VAE is video-shaped: its one frame.
        return super().decoded(rows)[:, :, 0]
