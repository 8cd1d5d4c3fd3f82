"""FLUX.1's denoiser as steps that requests share, reproducing FluxPipeline's
flow-matching loop (within 1e-4, tests/unit/test_flux.py).

Each step is one transformer forward for the whole batch, each row at its own request's
timestep and guidance: FLUX's text is T5's sequence padded to a fixed length and its
positions depend only on the image's size, so requests of one size join a running batch
at any step boundary with no padding or mask, and leave it at the next. No CFG: dev's
guidance is an input of the model (distilled), and schnell has none. Kontext's input
image rides along: its tokens follow the noise's in each row (their positions set apart
by the first axis), so its requests batch with those of the same input size. A masked
edit's rows put its input back outside the mask after each step (inpaint.py), each row
its own, so masked and unmasked edits share a batch. LoRA adapters and weight
quantization come from the stage kit (stagekit/dit_adapters.py, dit_quantize.py); a
request's adapter and scale are part of its batch key."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from omnipipe.api.adapters import Adapter
from omnipipe.families.flux.inpaint import MaskedBlend, pack_mask
from omnipipe.families.flux.loading import load_flux
from omnipipe.stagekit.dit_adapters import (
    LoadedAdapters,
    LoraChoice,
    lora_choice,
    lora_key,
)
from omnipipe.stagekit.dit_quantize import quantize_weights
from omnipipe.stagekit.params import float_param, int_param
from omnipipe.stagekit.stage import StageInputError, StageJob, StageResult, SteppedStage
from omnipipe.stagekit.usage import output_image_tokens


@dataclass
class FluxDenoising:
    """One request in flight: its latents and where it is in its schedule."""

    latents: torch.Tensor  # (n, image tokens, channels), packed
    image_ids: torch.Tensor  # (image tokens [+ context tokens], 3)
    text: torch.Tensor  # (n, length, dim)
    pooled: torch.Tensor  # (n, dim)
    guidance: float
    sigmas: torch.Tensor  # steps + 1, the last 0
    timesteps: torch.Tensor  # steps
    serial: int
    lora: LoraChoice = None
    index: int = 0
    # Kontext: the input image's packed latents (n, context tokens, channels), run after
    # the noise's tokens at every step; their predictions are dropped.
    context: torch.Tensor | None = None
    # A masked Kontext edit: what it keeps of its input after each step.
    blend: MaskedBlend | None = None

    def hidden(self) -> torch.Tensor:
        if self.context is None:
            return self.latents
        return torch.cat([self.latents, self.context], dim=1)


def size_of(params: dict[str, object]) -> tuple[int, int]:
    return int_param(params, "width", 1024), int_param(params, "height", 1024)


class FluxDenoiseStage(SteppedStage):
    """Flow-matching FLUX DiT denoising, guidance as the model's input -> latents."""

    accelerations = frozenset({"quantization"})
    takes_adapters = True

    def load(self) -> None:
        from diffusers import FluxPipeline

        self.pipe = load_flux(self.model_path, self.device, {"transformer", "scheduler"})
        if self.pipe.scheduler.config.get("stochastic_sampling"):
            # step() below is FlowMatchEulerDiscreteScheduler's deterministic Euler step.
            raise ValueError(f"{self.model_path}: a stochastic-sampling scheduler is not run here")
        self.guidance_embeds = bool(self.pipe.transformer.config.guidance_embeds)
        self._schedule = lru_cache(maxsize=64)(self._make_schedule)
        self._serials = itertools.count()
        acceleration = self.spec.acceleration
        if acceleration and acceleration.quantization:
            quantize_weights(self.pipe.transformer, acceleration.quantization)
        self.adapters = LoadedAdapters([self.pipe.transformer], self.spec.adapters, FluxPipeline)

    def set_adapters(self, adapters: Sequence[Adapter]) -> list[str]:
        return self.adapters.update(adapters)

    def batch_key(self, job: StageJob) -> Hashable | None:
        # Rows at different steps, guidance and prompts share a forward: only the image's
        # size (its positions), a Kontext input's grid and the LoRA adapter must agree.
        # The grid, not the token count: the trained sizes come in transposed pairs
        # (832x1248, 1248x832) of one count and other positions.
        ids = job.inputs.get("encode-image", {}).get("image_ids")
        grid = None if ids is None else (int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1)
        return (*size_of(job.params), grid, lora_key(job.params))

    def _make_schedule(self, steps: int, image_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scheduler's shifted sigmas and timesteps, as the pipeline sets them."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        config = scheduler.config
        mu = calculate_shift(
            image_tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        scheduler.set_timesteps(sigmas=sigmas, device=self.device, mu=mu)
        return scheduler.sigmas.clone(), scheduler.timesteps.clone()

    def begin(self, job: StageJob) -> FluxDenoising:
        from diffusers import FluxPipeline

        pipe, device = self.pipe, self.device
        lora = lora_choice(job.params, self.adapters.names)
        width, height = size_of(job.params)
        n = int_param(job.params, "n", 1)
        steps = int_param(job.params, "num_inference_steps", 28)
        seed = int_param(job.params, "seed", 0)
        enc = job.inputs["encode"]
        # The encoder's dtype may not be the DiT's (an encoder on the CPU, in float32).
        dtype = pipe.transformer.dtype
        text = enc["prompt_embeds"].to(device, dtype)
        generators = [torch.Generator(device="cpu").manual_seed(seed + i) for i in range(n)]
        channels = pipe.transformer.config.in_channels // 4
        # FluxPipeline's draw, whichever pipeline class the checkpoint is (Kontext's
        # prepare_latents draws the same noise, its input image aside).
        latents, image_ids = FluxPipeline.prepare_latents(
            pipe, n, channels, height, width, text.dtype, device, generators
        )
        # The shift follows the noise's tokens alone, a Kontext input's aside.
        sigmas, timesteps = self._schedule(steps, int(latents.shape[1]))
        context = blend = None
        if "encode-image" in job.inputs:
            image = job.inputs["encode-image"]
            context = image["image_latents"].to(device, dtype).repeat_interleave(n, dim=0)
            if "mask" in image:
                blend = self._masked(image, latents, context, width, height)
                latents = blend.start(sigmas)
            image_ids = torch.cat([image_ids, image["image_ids"].to(device, image_ids.dtype)])
        return FluxDenoising(
            latents=latents,
            image_ids=image_ids,
            text=text.repeat_interleave(n, dim=0),
            pooled=enc["pooled_prompt_embeds"].to(device, dtype).repeat_interleave(n, dim=0),
            guidance=float_param(job.params, "guidance_scale", 3.5),
            sigmas=sigmas,
            timesteps=timesteps,
            serial=next(self._serials),
            lora=lora,
            context=context,
            blend=blend,
        )

    def _masked(
        self,
        image: dict[str, torch.Tensor],
        noise: torch.Tensor,
        context: torch.Tensor,
        width: int,
        height: int,
    ) -> MaskedBlend:
        """A masked edit's blend: the input's latents are what it keeps, so the edit is
        made at the input's size (the router asks for that size)."""
        multiple = self.pipe.vae_scale_factor * 2
        ids = image["image_ids"]
        made = (int(ids[:, 2].max()) + 1) * multiple, (int(ids[:, 1].max()) + 1) * multiple
        if made != (width, height):
            raise StageInputError(
                f"size: a masked edit is made at its input's trained size, {made[0]}x{made[1]}, "
                f"not {width}x{height}",
                "size",
            )
        channels = noise.shape[2] // 4
        mask = pack_mask(image["mask"].to(self.device), channels).to(noise.dtype)
        return MaskedBlend(mask=mask.expand_as(noise), image=context.to(noise.dtype), noise=noise)

    def step(self, states: Sequence[FluxDenoising]) -> None:
        device = self.device
        rows = [len(s.latents) for s in states]
        hidden = torch.cat([s.hidden() for s in states])
        times = torch.cat([s.timesteps[s.index].expand(len(s.latents)) for s in states])
        guidance = None
        if self.guidance_embeds:
            guidance = torch.tensor(
                [s.guidance for s, k in zip(states, rows, strict=True) for _ in range(k)],
                device=device,
                dtype=torch.float32,
            )
        text = torch.cat([s.text for s in states])
        # A batch shares its key, and so its adapter.
        self.adapters.apply(states[0].lora)
        with torch.inference_mode():
            pred: torch.Tensor = self.pipe.transformer(
                hidden_states=hidden,
                timestep=times.to(device, hidden.dtype) / 1000,
                guidance=guidance,
                pooled_projections=torch.cat([s.pooled for s in states]),
                encoder_hidden_states=text,
                txt_ids=torch.zeros(text.shape[1], 3, device=device, dtype=text.dtype),
                img_ids=states[0].image_ids,
                joint_attention_kwargs={},
                return_dict=False,
            )[0]
        self.count_steps("computed", len(states))
        for state, out in zip(states, torch.split(pred, rows), strict=True):
            noise = out[:, : state.latents.shape[1]]
            sigma, after = state.sigmas[state.index], state.sigmas[state.index + 1]
            step = state.latents.to(torch.float32) + (after - sigma) * noise
            state.latents = step.to(noise.dtype)
            if state.blend is not None:
                state.latents = state.blend.keep(state.latents, state.sigmas, state.index)
            state.index += 1
        self.progress()

    def finished(self, state: FluxDenoising) -> bool:
        return state.index >= len(state.timesteps)

    def step_count(self, state: FluxDenoising) -> tuple[int, int] | None:
        return state.index, len(state.timesteps)

    def finish(self, state: FluxDenoising) -> StageResult:
        return StageResult(
            tensors={"latents": state.latents}, usage=output_image_tokens(state.latents)
        )
