"""Qwen-Image split into three stages, reproducing QwenImagePipeline.__call__:
encode (prompt and negative prompt in one batch) -> denoise (true CFG) -> decode."""

from __future__ import annotations

import base64
import io
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from omnipipe.worker.engines.diffusers import load_qwen_image
from omnipipe.worker.stages.base import Stage, StageInputError, StageJob, StageResult, Tensors

MAX_SEQUENCE_LENGTH = 512


def _int(params: dict[str, Any], key: str, default: int) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise StageInputError(f"{key} must be an integer")
    return value


def prompt_of(params: dict[str, Any]) -> str:
    prompt = params.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise StageInputError("prompt must be a non-empty string")
    return prompt


class TextEncodeStage(Stage):
    """Prompt (and negative prompt, for CFG) -> embeddings and masks."""

    def load(self) -> None:
        self.pipe = load_qwen_image(self.model_path, self.device, {"text_encoder", "tokenizer"})

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
        return StageResult(tensors=out)


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


class DenoiseStage(Stage):
    """Flow-matching DiT denoising with true CFG over the two embeddings -> latents."""

    def load(self) -> None:
        self.pipe = load_qwen_image(self.model_path, self.device, {"transformer", "scheduler"})

    @staticmethod
    def _geometry(params: dict[str, Any]) -> tuple[int, int, int, int, float]:
        width, height = _int(params, "width", 1024), _int(params, "height", 1024)
        n, steps = _int(params, "n", 1), _int(params, "num_inference_steps", 50)
        guidance = float(params.get("guidance_scale", 4.0))
        return width, height, n, steps, guidance

    def batch_key(self, job: StageJob) -> Hashable | None:
        width, height, _, steps, guidance = self._geometry(job.params)
        cfg = "negative_prompt_embeds" in job.inputs.get("encode", {})
        # Prompts of any length share a forward: run_batch pads them and masks the pad.
        return (width, height, steps, guidance if cfg else None, cfg)

    def run(self, job: StageJob) -> StageResult:
        return self.run_batch([job])[0]

    def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
        width, height, _, steps, guidance = self._geometry(jobs[0].params)
        encs = [job.inputs["encode"] for job in jobs]
        counts = [self._geometry(job.params)[2] for job in jobs]
        generators = [
            torch.Generator(device="cpu").manual_seed(_int(job.params, "seed", 0) + i)
            for job, n in zip(jobs, counts, strict=True)
            for i in range(n)
        ]

        def stack(key: str) -> torch.Tensor | None:
            if key not in encs[0]:
                return None
            return padded(
                [
                    e[key].to(self.device).repeat_interleave(n, dim=0)
                    for e, n in zip(encs, counts, strict=True)
                ]
            )

        pipe = self.pipe

        def stop_when_all_cancelled(
            _pipe: Any, _step: int, _t: Any, kwargs: dict[str, Any]
        ) -> dict[str, Any]:
            self.progress()
            # The pipeline checks `interrupt` before each step: nobody waits for this batch.
            if all(job.cancelled.is_set() for job in jobs):
                pipe._interrupt = True
            return kwargs

        with torch.inference_mode():
            latents = pipe(
                prompt_embeds=stack("prompt_embeds"),
                prompt_embeds_mask=stack("prompt_mask"),
                negative_prompt_embeds=stack("negative_prompt_embeds"),
                negative_prompt_embeds_mask=stack("negative_prompt_mask"),
                # Without a negative prompt there is no CFG; 1.0 says so to the pipeline.
                true_cfg_scale=guidance if "negative_prompt_embeds" in encs[0] else 1.0,
                height=height,
                width=width,
                num_inference_steps=steps,
                generator=generators,
                output_type="latent",
                callback_on_step_end=stop_when_all_cancelled,
            ).images
        results, start = [], 0
        for n in counts:
            results.append(StageResult(tensors={"latents": latents[start : start + n]}))
            start += n
        return results


class DecodeStage(Stage):
    """Latents -> VAE decode -> PNG images, base64 for the router."""

    def load(self) -> None:
        self.pipe = load_qwen_image(self.model_path, self.device, {"vae"})

    def run(self, job: StageJob) -> StageResult:
        pipe = self.pipe
        width, height = _int(job.params, "width", 1024), _int(job.params, "height", 1024)
        latents = job.inputs["denoise"]["latents"].to(self.device)
        with torch.inference_mode():
            latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
            latents = latents.to(pipe.vae.dtype)
            z = pipe.vae.config.z_dim
            mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1)
            std = torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1)
            latents = latents * std.to(latents) + mean.to(latents)
        outputs = []
        # One image at a time: a 2048x2048 decode's activations are held for one image,
        # and a cancel or the watchdog sees the engine between images.
        for one in latents.split(1):
            if job.cancelled.is_set():
                return StageResult()
            with torch.inference_mode():
                image = pipe.vae.decode(one, return_dict=False)[0][:, :, 0]
                [img] = pipe.image_processor.postprocess(image, output_type="pil")
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            outputs.append({"b64_json": base64.b64encode(buf.getvalue()).decode()})
            self.progress()
        return StageResult(outputs=outputs)
