"""Qwen-Image-Edit split into stages, reproducing QwenImageEditPipeline.__call__ (one
input image) and QwenImageEditPlusPipeline.__call__ (2509 and 2511: up to three): encode
(the edit prompt and the negative prompt, each beside the input images) and encode-image
(the VAE's latents of each input) -> denoise (true CFG, the inputs' latents joined to the
noise in sequence) -> decode (qwen_image.DecodeStage)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from omnipipe.api.edit import CONDITION_PIXELS, condition_size
from omnipipe.families.qwen_image import PLUS_MAX_IMAGES
from omnipipe.families.qwen_image.loading import QWEN_IMAGE_EDIT_PLUS, load_qwen_image
from omnipipe.families.qwen_image.stages import schedule_shift
from omnipipe.stagekit.media import decode_image
from omnipipe.stagekit.params import int_param, prompt_of
from omnipipe.stagekit.stage import Stage, StageInputError, StageJob, StageResult, Tensors
from omnipipe.stagekit.usage import input_image_tokens, output_image_tokens, prompt_tokens

# QwenImageEditPlusPipeline's: its vision-language encoder sees each input at about
# 384x384 (the VAE at a megapixel, as QwenImageEditPipeline's one input).
PLUS_CONDITION_PIXELS = 384 * 384


def is_plus(pipe: Any) -> bool:
    return type(pipe).__name__ == QWEN_IMAGE_EDIT_PLUS


def input_images(pipe: Any, params: dict[str, Any]) -> list[Image.Image]:
    """The request's input images, as many as the checkpoint edits with."""
    images = params.get("images")
    most = PLUS_MAX_IMAGES if is_plus(pipe) else 1
    if not isinstance(images, list) or not images:
        raise StageInputError("image: an input image is required", "image")
    if len(images) > most:
        raise StageInputError(
            f"image: this model edits with at most {most} input image{'s' * (most > 1)}, "
            f"got {len(images)}",
            "image",
        )
    return [decode_image(data, "image") for data in images]


def resized(pipe: Any, image: Image.Image, pixels: int = CONDITION_PIXELS) -> Image.Image:
    width, height = condition_size(image.width, image.height, pixels)
    out: Image.Image = pipe.image_processor.resize(image, height, width)
    return out


def encoder_images(pipe: Any, params: dict[str, Any]) -> list[Image.Image]:
    """What the vision-language encoder sees of each input, as the pipeline resizes it."""
    pixels = PLUS_CONDITION_PIXELS if is_plus(pipe) else CONDITION_PIXELS
    return [resized(pipe, image, pixels) for image in input_images(pipe, params)]


def vae_pixels(pipe: Any, image: Image.Image) -> torch.Tensor:
    """An input as the VAE takes it, (1, 3, 1, h, w) at about a megapixel: the Plus
    pipeline preprocesses the input itself to that size, the Edit one its resized copy."""
    if is_plus(pipe):
        width, height = condition_size(image.width, image.height)
        pixels: torch.Tensor = pipe.image_processor.preprocess(image, height, width)
    else:
        image = resized(pipe, image)
        pixels = pipe.image_processor.preprocess(image, image.height, image.width)
    return pixels.unsqueeze(2)


class EditTextEncodeStage(Stage):
    """Input image + edit prompt (and negative prompt) -> embeddings and masks.

    Each prompt is encoded on its own beside the image, as the pipeline does: a batch of
    two would need the image twice and pad the shorter prompt."""

    def load(self) -> None:
        self.pipe = load_qwen_image(
            self.model_path, self.device, {"text_encoder", "tokenizer", "processor"}
        )

    def text_tokenizer(self) -> Any:
        return self.pipe.tokenizer

    def run(self, job: StageJob) -> StageResult:
        prompt = prompt_of(job.params)
        images = encoder_images(self.pipe, job.params)
        # The Plus pipeline names each input ("Picture 1: ..."); the Edit one takes one.
        image: Any = images if is_plus(self.pipe) else images[0]
        negative = job.params.get("negative_prompt")
        out: Tensors = {}
        for prefix, text in (("prompt", prompt), ("negative_prompt", negative)):
            if not text:
                continue
            with torch.inference_mode():
                embeds, mask = self.pipe.encode_prompt(
                    prompt=[str(text)], image=image, device=self.device
                )
            if mask is None:  # the pipeline's way of saying "no padding"
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            out[f"{prefix}_embeds"], out[f"{prefix}_mask"] = embeds, mask
        texts = [str(t) for t in (prompt, negative) if t]
        return StageResult(tensors=out, usage=prompt_tokens(self.pipe.tokenizer, texts))


class ImageEncodeStage(Stage):
    """Input images -> the VAE's normalised latents of each (the distribution's mode),
    packed in 2x2 patches and joined in sequence, the denoiser's conditioning; and each
    one's packed (height, width)."""

    def load(self) -> None:
        self.pipe = load_qwen_image(self.model_path, self.device, {"vae"})

    def run(self, job: StageJob) -> StageResult:
        pipe = self.pipe
        z = pipe.vae.config.z_dim
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1)
        std = torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1)
        packed, shapes = [], []
        for image in input_images(pipe, job.params):
            pixels = vae_pixels(pipe, image).to(self.device, pipe.vae.dtype)
            with torch.inference_mode():
                latents = pipe.vae.encode(pixels).latent_dist.mode()
                latents = (latents - mean.to(latents)) / std.to(latents)
            packed.append(pack(latents))
            shapes.append([latents.shape[3] // 2, latents.shape[4] // 2])
        joined = torch.cat(packed, dim=1)
        return StageResult(
            tensors={"image_latents": joined, "image_shapes": torch.tensor(shapes)},
            usage=input_image_tokens(joined),
        )


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(batch, channels, 1, h, w) -> (batch, h/2 * w/2, channels * 4): 2x2 patches."""
    b, c, _, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


class EditDenoiseStage(Stage):
    """Flow-matching DiT denoising of noise latents followed in sequence by the input
    image's latents, with true CFG over the two embeddings -> latents of the edit."""

    def load(self) -> None:
        self.pipe = load_qwen_image(self.model_path, self.device, {"transformer", "scheduler"})

    @staticmethod
    def _geometry(params: dict[str, Any]) -> tuple[int, int, int, float]:
        width, height = int_param(params, "width", 1024), int_param(params, "height", 1024)
        steps = int_param(params, "num_inference_steps", 50)
        return width, height, steps, float(params.get("guidance_scale", 4.0))

    def batch_key(self, job: StageJob) -> Hashable | None:
        enc, img = job.inputs.get("encode", {}), job.inputs.get("encode-image", {})
        shapes = tuple((k, tuple(v.shape)) for k, v in sorted({**enc, **img}.items()))
        # Inputs of other sizes with as many latents in all place them otherwise.
        inputs = img.get("image_shapes")
        sizes = () if inputs is None else tuple(map(tuple, inputs.tolist()))
        return (self._geometry(job.params), shapes, sizes)

    def run(self, job: StageJob) -> StageResult:
        return self.run_batch([job])[0]

    def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
        pipe, device = self.pipe, self.device
        width, height, steps, guidance = self._geometry(jobs[0].params)
        counts = [int_param(job.params, "n", 1) for job in jobs]
        encs = [{**job.inputs["encode"], **job.inputs["encode-image"]} for job in jobs]

        def stack(key: str) -> torch.Tensor | None:
            if key not in encs[0]:
                return None
            rows = [
                e[key].to(device).repeat_interleave(n, dim=0)
                for e, n in zip(encs, counts, strict=True)
            ]
            return torch.cat(rows)

        def mask_of(key: str) -> torch.Tensor | None:
            # An all-ones mask is None to the pipeline, and to its attention path.
            mask = stack(key)
            return None if mask is None or bool(mask.all()) else mask

        embeds, mask = stack("prompt_embeds"), mask_of("prompt_mask")
        neg_embeds, neg_mask = stack("negative_prompt_embeds"), mask_of("negative_prompt_mask")
        image_latents = stack("image_latents")
        assert embeds is not None
        assert image_latents is not None
        dtype = embeds.dtype
        image_latents = image_latents.to(dtype)
        do_cfg = neg_embeds is not None and guidance > 1

        scale = pipe.vae_scale_factor
        channels = pipe.transformer.config.in_channels // 4
        lat_h, lat_w = 2 * (height // (scale * 2)), 2 * (width // (scale * 2))
        # One generator per image, seeded as in text to image: seed, seed + 1, ...
        noise = [
            torch.randn(
                (1, 1, channels, lat_h, lat_w),
                generator=torch.Generator(device="cpu").manual_seed(
                    int_param(job.params, "seed", 0) + i
                ),
                dtype=dtype,
            )
            for job, n in zip(jobs, counts, strict=True)
            for i in range(n)
        ]
        # (n, 1, channels, h, w) noise read as (n, channels, 1, h, w), as the pipeline packs it.
        latents = pack(torch.cat(noise).reshape(-1, channels, 1, lat_h, lat_w)).to(device)
        inputs = jobs[0].inputs["encode-image"]["image_shapes"].tolist()
        img_shapes = [[(1, lat_h // 2, lat_w // 2), *((1, h, w) for h, w in inputs)]] * len(latents)

        scheduler = pipe.scheduler
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = schedule_shift(scheduler.config, latents.shape[1])
        scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)
        scheduler.set_begin_index(0)

        def predict(
            model_input: torch.Tensor,
            timestep: torch.Tensor,
            text: torch.Tensor,
            text_mask: torch.Tensor | None,
            context: str,
        ) -> torch.Tensor:
            with pipe.transformer.cache_context(context):
                out = pipe.transformer(
                    hidden_states=model_input,
                    timestep=timestep / 1000,
                    guidance=None,
                    encoder_hidden_states_mask=text_mask,
                    encoder_hidden_states=text,
                    img_shapes=img_shapes,
                    attention_kwargs={},
                    return_dict=False,
                )[0]
            # The transformer answers for the image latents too; only the noise's count.
            return out[:, : latents.size(1)]  # type: ignore[no-any-return]

        with torch.inference_mode():
            for t in scheduler.timesteps:
                # Stop between steps once nobody waits for this batch.
                if all(job.cancelled.is_set() for job in jobs):
                    break
                model_input = torch.cat([latents, image_latents], dim=1)
                timestep = t.expand(latents.shape[0]).to(latents.dtype)
                pred = predict(model_input, timestep, embeds, mask, "cond")
                if do_cfg:
                    assert neg_embeds is not None
                    neg = predict(model_input, timestep, neg_embeds, neg_mask, "uncond")
                    combined = neg + guidance * (pred - neg)
                    # Rescale to the conditional prediction's norm, as the pipeline does.
                    pred = combined * (
                        torch.norm(pred, dim=-1, keepdim=True)
                        / torch.norm(combined, dim=-1, keepdim=True)
                    )
                latents = scheduler.step(pred, t, latents, return_dict=False)[0]
                self.progress()
        results, start = [], 0
        for n in counts:
            mine = latents[start : start + n]
            results.append(StageResult(tensors={"latents": mine}, usage=output_image_tokens(mine)))
            start += n
        return results
