"""FLUX.2's denoiser as steps that requests share, reproducing the flow-matching loops of
Flux2Pipeline and Flux2KleinPipeline (within 1e-4, tests/unit/test_flux2.py).

Each step is one transformer forward for the whole batch, each row at its own request's
timestep: FLUX.2's text is padded to 512 tokens and attended unmasked, as the pipelines
do, and its positions depend only on the image's size, so requests of one size join a
running batch at any step boundary with no padding of ours, and leave it at the next.
dev's guidance is an input of the model (distilled), one value per row. klein's CFG runs
its unconditional rows in the same forward as every request's conditional ones, never a
second forward; a step-distilled klein has none. An edit's reference images ride along
(edit.py): their tokens follow the noise's in each row, their own rows under CFG too, so
an edit batches with the edits whose references have the same grids in the same order.
LoRA adapters and weight quantization come from the stage kit (stagekit/dit_adapters.py,
dit_quantize.py); a request's adapter and scale are part of its batch key."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from omnipipe.api.adapters import Adapter
from omnipipe.families.flux2.loading import load_flux2
from omnipipe.families.flux2.stages import DEFAULT_GUIDANCE
from omnipipe.stagekit.dit_adapters import LoadedAdapters, LoraChoice, lora_choice, lora_key
from omnipipe.stagekit.dit_quantize import quantize_weights
from omnipipe.stagekit.params import float_param, int_param
from omnipipe.stagekit.stage import StageJob, StageResult, SteppedStage
from omnipipe.stagekit.usage import output_image_tokens

# Both pipelines' default step count.
DEFAULT_STEPS = 50


@dataclass
class Flux2Denoising:
    """One request in flight: its latents and where it is in its schedule."""

    latents: torch.Tensor  # (n, image tokens, channels), packed
    image_ids: torch.Tensor  # (image tokens [+ reference tokens], 4)
    text: torch.Tensor  # (n, 512, dim)
    negative: torch.Tensor | None  # (n, 512, dim): klein's CFG, else None
    guidance: float
    sigmas: torch.Tensor  # steps + 1, the last 0
    timesteps: torch.Tensor  # steps
    serial: int
    lora: LoraChoice = None
    index: int = 0
    # An edit: its reference images' packed latents (n, reference tokens, channels), run
    # after the noise's tokens at every step; their predictions are dropped.
    context: torch.Tensor | None = None

    def hidden(self) -> torch.Tensor:
        if self.context is None:
            return self.latents
        return torch.cat([self.latents, self.context], dim=1)


def size_of(params: dict[str, object]) -> tuple[int, int]:
    return int_param(params, "width", 1024), int_param(params, "height", 1024)


def reference_grids(job: StageJob) -> tuple[tuple[int, int, int], ...] | None:
    """Each reference image's (time, rows, columns) in order: what its positions are,
    where the token count alone is not (a 2x3 and a 3x2 reference, or one 6x1)."""
    ids = job.inputs.get("encode-image", {}).get("image_ids")
    if ids is None:
        return None
    times, counts = torch.unique_consecutive(ids[:, 0], return_counts=True)
    parts = torch.split(ids, counts.tolist())
    return tuple(
        (int(t), int(part[:, 1].max()) + 1, int(part[:, 2].max()) + 1)
        for t, part in zip(times.tolist(), parts, strict=True)
    )


class Flux2DenoiseStage(SteppedStage):
    """Flow-matching Flux2 DiT denoising -> latents: dev's guidance as the model's input,
    klein's as true CFG."""

    accelerations = frozenset({"quantization"})
    takes_adapters = True

    def load(self) -> None:
        self.pipe = load_flux2(self.model_path, self.device, {"transformer", "scheduler"})
        config = self.pipe.scheduler.config
        if config.get("stochastic_sampling") or config.get("use_flow_sigmas"):
            # step() below is FlowMatchEulerDiscreteScheduler's deterministic Euler step
            # over the pipelines' own sigmas.
            raise ValueError(f"{self.model_path}: this scheduler configuration is not run here")
        self.guidance_embeds = bool(self.pipe.transformer.config.guidance_embeds)
        self._schedule = lru_cache(maxsize=64)(self._make_schedule)
        self._serials = itertools.count()
        acceleration = self.spec.acceleration
        if acceleration and acceleration.quantization:
            quantize_weights(self.pipe.transformer, acceleration.quantization)
        self.adapters = LoadedAdapters([self.pipe.transformer], self.spec.adapters, type(self.pipe))

    def set_adapters(self, adapters: Sequence[Adapter]) -> list[str]:
        return self.adapters.update(adapters)

    def batch_key(self, job: StageJob) -> Hashable | None:
        # Rows at different steps, guidance and prompts, with CFG or without, share a
        # forward: only the image's size and an edit's references (their positions) and
        # the LoRA adapter must agree.
        return (*size_of(job.params), reference_grids(job), lora_key(job.params))

    def _make_schedule(self, steps: int, image_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scheduler's shifted sigmas and timesteps, as the pipelines set them."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        mu = compute_empirical_mu(image_seq_len=image_tokens, num_steps=steps)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        scheduler.set_timesteps(sigmas=sigmas, device=self.device, mu=mu)
        return scheduler.sigmas.clone(), scheduler.timesteps.clone()

    def begin(self, job: StageJob) -> Flux2Denoising:
        pipe, device = self.pipe, self.device
        lora = lora_choice(job.params, self.adapters.names)
        width, height = size_of(job.params)
        n = int_param(job.params, "n", 1)
        steps = int_param(job.params, "num_inference_steps", DEFAULT_STEPS)
        seed = int_param(job.params, "seed", 0)
        enc = job.inputs["encode"]
        # The encoder's dtype may not be the DiT's (an encoder on the CPU, in float32).
        dtype = pipe.transformer.dtype
        text = enc["prompt_embeds"].to(device, dtype)
        generators = [torch.Generator(device="cpu").manual_seed(seed + i) for i in range(n)]
        channels = pipe.transformer.config.in_channels // 4
        latents, image_ids = pipe.prepare_latents(
            n, channels, height, width, text.dtype, device, generators
        )
        sigmas, timesteps = self._schedule(steps, int(latents.shape[1]))
        negative = enc.get("negative_prompt_embeds")
        if negative is not None:
            negative = negative.to(device, dtype).repeat_interleave(n, dim=0)
        # The shift above follows the noise's tokens alone, the references' aside.
        ids, context = image_ids[0], None
        if "encode-image" in job.inputs:
            references = job.inputs["encode-image"]
            context = references["image_latents"].to(device, dtype).repeat_interleave(n, dim=0)
            ids = torch.cat([ids, references["image_ids"].to(device, ids.dtype)])
        return Flux2Denoising(
            latents=latents,
            image_ids=ids,
            text=text.repeat_interleave(n, dim=0),
            negative=negative,
            guidance=float_param(job.params, "guidance_scale", DEFAULT_GUIDANCE),
            sigmas=sigmas,
            timesteps=timesteps,
            serial=next(self._serials),
            lora=lora,
            context=context,
        )

    def _predict(self, states: Sequence[Flux2Denoising]) -> list[torch.Tensor]:
        """Each request's noise prediction, from one forward of every request's
        conditional rows followed by the CFG requests' unconditional ones (an edit's
        with its references, as the pipeline's)."""
        device = self.device
        cfg = [s for s in states if s.negative is not None and s.guidance > 1]
        rows = [*states, *cfg]
        texts = [*(s.text for s in states), *(s.negative for s in cfg if s.negative is not None)]
        sizes = [len(s.latents) for s in rows]
        hidden = torch.cat([s.hidden() for s in rows]).to(self.pipe.transformer.dtype)
        times = torch.cat([s.timesteps[s.index].expand(len(s.latents)) for s in rows])
        guidance = None
        if self.guidance_embeds:
            values = [s.guidance for s, k in zip(rows, sizes, strict=True) for _ in range(k)]
            guidance = torch.tensor(values, device=device, dtype=torch.float32)
        text = torch.cat(texts)
        text_ids = torch.cartesian_prod(*(torch.arange(k) for k in (1, 1, 1, text.shape[1])))
        with torch.inference_mode():
            pred: torch.Tensor = self.pipe.transformer(
                hidden_states=hidden,
                timestep=times.to(device, states[0].latents.dtype) / 1000,
                guidance=guidance,
                encoder_hidden_states=text,
                txt_ids=text_ids.to(device),
                img_ids=states[0].image_ids,
                joint_attention_kwargs={},
                return_dict=False,
            )[0]
        # The noise's tokens come first in every row; the references' are dropped.
        parts = [
            part[:, : s.latents.shape[1]]
            for s, part in zip(rows, torch.split(pred, sizes), strict=True)
        ]
        uncond = dict(zip(map(id, cfg), parts[len(states) :], strict=True))
        preds = []
        for state, cond in zip(states, parts[: len(states)], strict=True):
            if (neg := uncond.get(id(state))) is not None:
                cond = neg + state.guidance * (cond - neg)
            preds.append(cond)
        return preds

    def step(self, states: Sequence[Flux2Denoising]) -> None:
        # A batch shares its key, and so its adapter.
        self.adapters.apply(states[0].lora)
        preds = self._predict(states)
        self.count_steps("computed", len(states))
        for state, noise in zip(states, preds, strict=True):
            sigma, after = state.sigmas[state.index], state.sigmas[state.index + 1]
            step = state.latents.to(torch.float32) + (after - sigma) * noise
            state.latents = step.to(noise.dtype)
            state.index += 1
        self.progress()

    def finished(self, state: Flux2Denoising) -> bool:
        return state.index >= len(state.timesteps)

    def step_count(self, state: Flux2Denoising) -> tuple[int, int] | None:
        return state.index, len(state.timesteps)

    def finish(self, state: Flux2Denoising) -> StageResult:
        return StageResult(
            tensors={"latents": state.latents}, usage=output_image_tokens(state.latents)
        )
