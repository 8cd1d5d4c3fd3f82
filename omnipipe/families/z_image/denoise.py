"""Z-Image's denoiser as steps that requests share, reproducing ZImagePipeline's
flow-matching loop with its CFG (within 1e-4, tests/unit/test_z_image.py).

Each step is one transformer forward for the whole batch: every request's rows (one per
image) and, under CFG, its negative rows after all the positive ones, as the pipeline
orders a request's two halves; each row at its own request's timestep. The DiT takes its
captions as a list of different lengths: it pads each to a multiple of 32 with a learned
pad token and pads the batch to its longest row, masking the tail. So a request's result
could depend on the lengths beside it. Measured on tiny://z-image (float32, CPU): a row
forwarded beside rows of other padded caption lengths differs from the same row forwarded
alone by at most 7e-7, well within 1e-4, and a request's own CFG forward already mixes
two lengths exactly as the pipeline does. So the caption length is not part of the batch
key: requests of one image size (their image tokens) and LoRA adapter join a running
batch at any step boundary and leave it at the next, whatever their prompts, guidance,
step counts or CFG (tests/unit/test_z_image.py proves batched equals alone within 1e-4).

The CFG is the pipeline's: pred = pos + scale * (pos - neg), optionally renormalised to
cfg_normalization times the positive prediction's norm and switched off past
cfg_truncation (ZImagePipeline's two options; by default neither acts). LoRA adapters
and weight quantization come from the stage kit (stagekit/dit_adapters.py,
dit_quantize.py); a request's adapter and scale are part of its batch key. The step cache
is cache-dit's DBCache over the main blocks (step_cache.py): a cached group runs from its
first step to its last, none joining, and its requests agree on their step count."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from omnipipe.api.adapters import Adapter
from omnipipe.families.z_image.loading import load_z_image
from omnipipe.families.z_image.stages import DEFAULT_GUIDANCE, size_of
from omnipipe.families.z_image.step_cache import StepCacher
from omnipipe.stagekit.dit_adapters import LoadedAdapters, LoraChoice, lora_choice, lora_key
from omnipipe.stagekit.dit_quantize import quantize_weights
from omnipipe.stagekit.params import float_param, int_param
from omnipipe.stagekit.stage import StageInputError, StageJob, StageResult, SteppedStage
from omnipipe.stagekit.usage import output_image_tokens

log = logging.getLogger(__name__)
# ZImagePipeline.__call__'s default step count.
DEFAULT_STEPS = 50


@dataclass
class ZImageDenoising:
    """One request in flight: its latents and where it is in its schedule."""

    latents: torch.Tensor  # (n, channels, height, width), float32 as in the pipeline
    text: torch.Tensor  # (length, dim): every image's caption
    neg_text: torch.Tensor | None  # (length, dim) under CFG
    guidance: float
    normalization: float  # 0: off
    truncation: float
    sigmas: torch.Tensor  # steps + 1, the last 0
    timesteps: torch.Tensor  # steps
    serial: int
    lora: LoraChoice = None
    index: int = 0
    reused: int = 0

    def guidance_now(self) -> float:
        """This step's scale: 0 (no CFG) past the truncation, as the pipeline sets it."""
        if self.neg_text is None:
            return 0.0
        t_norm = float((1000 - self.timesteps[self.index].float()) / 1000)
        return 0.0 if self.truncation <= 1 and t_norm > self.truncation else self.guidance


class ZImageDenoiseStage(SteppedStage):
    """Flow-matching Z-Image DiT denoising with the pipeline's CFG -> latents."""

    accelerations = frozenset({"cache", "quantization"})
    takes_adapters = True

    def load(self) -> None:
        from diffusers import ZImagePipeline

        self.pipe = load_z_image(self.model_path, self.device, {"transformer", "scheduler"})
        if self.pipe.scheduler.config.get("stochastic_sampling"):
            # The step below is FlowMatchEulerDiscreteScheduler's deterministic Euler step.
            raise ValueError(f"{self.model_path}: a stochastic-sampling scheduler is not run here")
        self._schedule = lru_cache(maxsize=64)(self._make_schedule)
        self._serials = itertools.count()
        acceleration = self.spec.acceleration
        cache = acceleration.cache if acceleration else None
        if acceleration and acceleration.quantization:
            quantize_weights(self.pipe.transformer, acceleration.quantization)
        self.cacher = StepCacher(self.pipe.transformer, cache) if cache else None
        self.adapters = LoadedAdapters([self.pipe.transformer], self.spec.adapters, ZImagePipeline)

    def set_adapters(self, adapters: Sequence[Adapter]) -> list[str]:
        return self.adapters.update(adapters)

    @property
    def joins_between_steps(self) -> bool:
        return self.cacher is None

    def batch_key(self, job: StageJob) -> Hashable | None:
        # Rows at different steps, guidance, prompts and caption lengths share a forward
        # (the module docstring says why the lengths may): only the image's size and the
        # LoRA adapter must agree. A cached group runs its steps together, so its requests
        # agree on how many.
        key = (*size_of(job.params), lora_key(job.params))
        if self.cacher is None:
            return key
        return (*key, int_param(job.params, "num_inference_steps", DEFAULT_STEPS))

    def _make_schedule(self, steps: int, image_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scheduler's shifted sigmas and timesteps, as the pipeline sets them (the
        released schedulers shift by a fixed amount; mu is read where one shifts by size)."""
        from diffusers.pipelines.z_image.pipeline_z_image import (
            calculate_shift,
            get_default_z_image_sigmas,
        )

        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        config = scheduler.config
        mu = calculate_shift(
            image_tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(steps), device=self.device, mu=mu)
        return scheduler.sigmas.clone(), scheduler.timesteps.clone()

    def begin(self, job: StageJob) -> ZImageDenoising:
        pipe, device, params = self.pipe, self.device, job.params
        lora = lora_choice(params, self.adapters.names)
        width, height = size_of(params)
        n = int_param(params, "n", 1)
        steps = int_param(params, "num_inference_steps", DEFAULT_STEPS)
        seed = int_param(params, "seed", 0)
        normalization = float_param(params, "cfg_normalization", 0.0)
        truncation = float_param(params, "cfg_truncation", 1.0)
        side = pipe.vae_scale_factor * 2
        if width % side or height % side:
            raise StageInputError(f"size: each side must be a multiple of {side}", "size")
        enc = job.inputs["encode"]
        # The encoder's dtype may not be the DiT's (an encoder on the CPU, in float32).
        dtype = pipe.transformer.dtype
        neg = enc.get("negative_prompt_embeds")
        generators = [torch.Generator(device="cpu").manual_seed(seed + i) for i in range(n)]
        latents = pipe.prepare_latents(
            n, pipe.transformer.in_channels, height, width, torch.float32, device, generators
        )
        image_tokens = (latents.shape[2] // 2) * (latents.shape[3] // 2)
        sigmas, timesteps = self._schedule(steps, image_tokens)
        return ZImageDenoising(
            latents=latents,
            text=enc["prompt_embeds"].to(device, dtype),
            neg_text=None if neg is None else neg.to(device, dtype),
            guidance=float_param(params, "guidance_scale", DEFAULT_GUIDANCE),
            normalization=normalization,
            truncation=truncation,
            sigmas=sigmas,
            timesteps=timesteps,
            serial=next(self._serials),
            lora=lora,
        )

    def step(self, states: Sequence[ZImageDenoising]) -> None:
        dtype = self.pipe.transformer.dtype
        cfg = [s for s in states if s.guidance_now() > 0]
        # The positive rows of every request, then the negative rows of those under CFG.
        halves = [(s, s.text) for s in states] + [(s, s.neg_text) for s in cfg]
        latents, captions, times = [], [], []
        for state, caption in halves:
            assert caption is not None
            t = state.timesteps[state.index].expand(len(state.latents))
            latents += list(state.latents.to(dtype).unsqueeze(2).unbind(dim=0))
            captions += [caption] * len(state.latents)
            times.append((1000 - t) / 1000)
        if self.cacher is not None:
            steps_left = len(states[0].timesteps) - states[0].index
            group = (tuple(s.serial for s in states), tuple(s.serial for s in cfg))
            self.cacher.start_step(group, steps_left)
        # A batch shares its key, and so its adapter.
        self.adapters.apply(states[0].lora)
        with torch.inference_mode():
            out: list[torch.Tensor] = self.pipe.transformer(
                latents, torch.cat(times), captions, return_dict=False
            )[0]
        reused = self.cacher is not None and self.cacher.reused_last_step()
        self.count_steps("reused" if reused else "computed", len(states))
        rows = iter(out)
        positive = {id(s): [next(rows).float() for _ in s.latents] for s in states}
        negative = {id(s): [next(rows).float() for _ in s.latents] for s in cfg}
        for state in states:
            scale = state.guidance_now()
            preds = []
            for j, pos in enumerate(positive[id(state)]):
                pred = pos
                if scale > 0:
                    pred = pos + scale * (pos - negative[id(state)][j])
                    if state.normalization > 0:
                        most = torch.linalg.vector_norm(pos) * state.normalization
                        if (norm := torch.linalg.vector_norm(pred)) > most:
                            pred = pred * (most / norm)
                preds.append(pred)
            # The model predicts the flow from data to noise; the pipeline steps along
            # its negation.
            noise = -torch.stack(preds).squeeze(2)
            sigma, after = state.sigmas[state.index], state.sigmas[state.index + 1]
            state.latents = state.latents + (after - sigma) * noise
            state.index += 1
            state.reused += reused
        self.progress()

    def finished(self, state: ZImageDenoising) -> bool:
        return state.index >= len(state.timesteps)

    def step_count(self, state: ZImageDenoising) -> tuple[int, int] | None:
        return state.index, len(state.timesteps)

    def finish(self, state: ZImageDenoising) -> StageResult:
        if self.cacher is not None:
            log.info(
                "request %d of this stage: %d steps computed, %d reused from the step cache",
                state.serial,
                state.index - state.reused,
                state.reused,
            )
        patch = self.pipe.transformer.config.all_patch_size[0]
        return StageResult(
            tensors={"latents": state.latents}, usage=output_image_tokens(state.latents, patch)
        )
