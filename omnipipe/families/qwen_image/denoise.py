"""Qwen-Image's denoiser as steps that requests share, reproducing QwenImagePipeline's
flow-matching loop with true CFG (within 1e-4, tests/unit/test_batching.py).

Unlike the pipeline's loop, each step is one transformer forward for the whole batch:
every request's conditional rows and, under CFG, its unconditional rows beside them (text
padded to the longest and the pad masked), each row at its own request's timestep. So
requests join a running batch at any step boundary and leave it at the next, and CFG
costs one forward of twice the rows, never two forwards. That is the CPU's way; on a GPU
a step runs one unmasked forward per text length instead (SteppedDenoiseStage.load says
why). With CFG-parallel
(acceleration.cfgParallelSize 2) the unconditional rows run on a second device at the same
time instead (cfg_parallel.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from omnipipe.api.adapters import Adapter
from omnipipe.families.qwen_image.cfg_parallel import BranchDevice
from omnipipe.families.qwen_image.loading import load_qwen_image
from omnipipe.families.qwen_image.stages import geometry, padded, schedule_shift
from omnipipe.families.qwen_image.step_cache import StepCacher
from omnipipe.stagekit.dit_adapters import (
    LoadedAdapters,
    LoraChoice,
    lora_choice,
    lora_key,
)
from omnipipe.stagekit.dit_quantize import quantize_weights
from omnipipe.stagekit.params import int_param
from omnipipe.stagekit.stage import StageJob, StageResult, SteppedStage
from omnipipe.stagekit.usage import output_image_tokens

log = logging.getLogger(__name__)


@dataclass
class Denoising:
    """One request in flight: its latents and where it is in its schedule."""

    latents: torch.Tensor  # (n, image tokens, channels), packed
    text: torch.Tensor  # (n, length, dim)
    mask: torch.Tensor  # (n, length)
    neg_text: torch.Tensor | None
    neg_mask: torch.Tensor | None
    guidance: float
    sigmas: torch.Tensor  # steps + 1, the last 0
    timesteps: torch.Tensor  # steps
    image_shape: tuple[int, int, int]
    serial: int  # the stage's count of requests begun: what tells one group from the next
    lora: LoraChoice = None
    index: int = 0
    reused: int = 0


# A forward's row group: its request, and the text (and mask) it is conditioned on.
Row = tuple[Denoising, torch.Tensor, torch.Tensor]


class SteppedDenoiseStage(SteppedStage):
    """Flow-matching DiT denoising with true CFG over the two embeddings -> latents."""

    accelerations = frozenset({"cache", "cfgParallelSize", "quantization"})
    takes_adapters = True

    def load(self) -> None:
        self.pipe = load_qwen_image(self.model_path, self.device, {"transformer", "scheduler"})
        self._schedule = lru_cache(maxsize=64)(self._make_schedule)
        self._serials = itertools.count()
        acceleration = self.spec.acceleration
        cache = acceleration.cache if acceleration else None
        if acceleration and acceleration.quantization:
            quantize_weights(self.pipe.transformer, acceleration.quantization)
        self.cacher = StepCacher(self.pipe.transformer, cache) if cache else None
        # Texts of different lengths share a forward padded and masked. On a GPU the
        # masked forward costs more than one forward per length: torch's flash attention
        # takes no mask, and the kernel that does is slower. Qwen-Image at 1024x1024 on
        # an H200, one step of CFG's two rows: 380 ms masked, 370 ms as two forwards
        # (354 ms unmasked together; on an H100 391, 394 and 365):
        # bench/diffusion_real_size.py's step probe. On the CPU one padded forward is
        # the cheaper. A step cache compares each forward with the one before, so a
        # cached stage keeps to one forward a step.
        self.forward_per_text_length = self.device.type == "cuda" and cache is None
        self.branch = (
            BranchDevice(self._load_transformer, self.device)
            if acceleration and acceleration.cfg_parallel_size > 1
            else None
        )
        copies = [self.pipe.transformer, *([self.branch.transformer] if self.branch else [])]
        self.adapters = LoadedAdapters(copies, self.spec.adapters, type(self.pipe))
        if acceleration and acceleration.quantization:
            log.info("the DiT's linear weights are %s", acceleration.quantization.method)
        if self.branch is not None:
            log.info(
                "CFG-parallel: negative branches run on %s, positive ones on %s",
                self.branch.device,
                self.device,
            )

    def set_adapters(self, adapters: Sequence[Adapter]) -> list[str]:
        return self.adapters.update(adapters)

    def _load_transformer(self, device: torch.device) -> torch.nn.Module:
        """The DiT alone on `device`, quantized as the stage's own is."""
        transformer: torch.nn.Module = load_qwen_image(
            self.model_path, device, {"transformer"}
        ).transformer
        acceleration = self.spec.acceleration
        if acceleration and acceleration.quantization:
            quantize_weights(transformer, acceleration.quantization)
        return transformer

    @property
    def joins_between_steps(self) -> bool:
        return self.cacher is None

    def batch_key(self, job: StageJob) -> Hashable | None:
        width, height, _, steps, _ = geometry(job.params)
        # Rows at different steps, guidance scales and prompts, with CFG or without,
        # share a forward: only the image's size and the LoRA adapter must agree. A
        # cached group runs its steps together, so its requests agree on how many.
        key = (width, height, lora_key(job.params))
        return key if self.cacher is None else (*key, steps)

    def _make_schedule(self, steps: int, image_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scheduler's shifted sigmas and timesteps, as the pipeline sets them."""
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = schedule_shift(scheduler.config, image_tokens)
        scheduler.set_timesteps(sigmas=sigmas, device=self.device, mu=mu)
        return scheduler.sigmas.clone(), scheduler.timesteps.clone()

    def begin(self, job: StageJob) -> Denoising:
        pipe, device = self.pipe, self.device
        lora = lora_choice(job.params, self.adapters.names)
        width, height, n, steps, guidance = geometry(job.params)
        enc = job.inputs["encode"]
        seed = int_param(job.params, "seed", 0)
        generators = [torch.Generator(device="cpu").manual_seed(seed + i) for i in range(n)]
        text = enc["prompt_embeds"].to(device)
        channels = pipe.transformer.config.in_channels // 4
        latents = pipe.prepare_latents(
            n, channels, height, width, text.dtype, device, generators, None
        )
        sigmas, timesteps = self._schedule(steps, int(latents.shape[1]))
        scale = pipe.vae_scale_factor

        def rows(key: str) -> torch.Tensor | None:
            return enc[key].to(device).repeat_interleave(n, dim=0) if key in enc else None

        neg = rows("negative_prompt_embeds")
        return Denoising(
            latents=latents,
            text=text.repeat_interleave(n, dim=0),
            mask=enc["prompt_mask"].to(device).repeat_interleave(n, dim=0),
            neg_text=neg,
            neg_mask=rows("negative_prompt_mask"),
            guidance=guidance if neg is not None else 1.0,
            sigmas=sigmas,
            timesteps=timesteps,
            image_shape=(1, height // scale // 2, width // scale // 2),
            serial=next(self._serials),
            lora=lora,
        )

    def _predict(
        self,
        transformer: torch.nn.Module,
        positive: Sequence[Denoising],
        negative: Sequence[Denoising],
        device: torch.device,
    ) -> torch.Tensor:
        """The noise predictions on `device`: the conditional rows of `positive`, then the
        unconditional rows of `negative`, in that order."""
        rows: list[Row] = [(s, s.text, s.mask) for s in positive]
        for state in negative:
            assert state.neg_text is not None
            assert state.neg_mask is not None
            rows.append((state, state.neg_text, state.neg_mask))
        if not self.forward_per_text_length:
            return self._forward(transformer, rows, device)
        by_length: dict[int, list[int]] = {}
        for i, (_, text, _) in enumerate(rows):
            by_length.setdefault(text.shape[1], []).append(i)
        parts: dict[int, torch.Tensor] = {}
        for indices in by_length.values():
            pred = self._forward(transformer, [rows[i] for i in indices], device)
            sizes = [len(rows[i][0].latents) for i in indices]
            parts.update(zip(indices, torch.split(pred, sizes), strict=True))
        return torch.cat([parts[i] for i in range(len(rows))])

    def _forward(
        self, transformer: torch.nn.Module, rows: Sequence[Row], device: torch.device
    ) -> torch.Tensor:
        """One transformer forward of `rows`, their text padded to the longest and the pad
        masked."""
        states = [state for state, _, _ in rows]
        hidden = torch.cat([s.latents for s in states]).to(device)
        times = torch.cat([s.timesteps[s.index].expand(len(s.latents)) for s in states])
        mask = padded([m for _, _, m in rows]).to(device)
        with torch.inference_mode():
            pred: torch.Tensor = transformer(
                hidden_states=hidden,
                timestep=times.to(device, hidden.dtype) / 1000,
                guidance=None,
                # All ones is None to the transformer, as in the pipeline's own calls.
                encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                encoder_hidden_states=padded([t for _, t, _ in rows]).to(device),
                img_shapes=[[states[0].image_shape]] * len(hidden),
                attention_kwargs={},
                return_dict=False,
            )[0]
        return pred

    def finished(self, state: Denoising) -> bool:
        return state.index >= len(state.timesteps)

    def finish(self, state: Denoising) -> StageResult:
        if self.cacher is not None:
            log.info(
                "request %d of this stage: %d steps computed, %d reused from the step cache",
                state.serial,
                state.index - state.reused,
                state.reused,
            )
        return StageResult(
            tensors={"latents": state.latents}, usage=output_image_tokens(state.latents)
        )

    def step(self, states: Sequence[Denoising]) -> None:
        cfg = [s for s in states if s.neg_text is not None and s.guidance > 1]
        if self.cacher is not None:
            steps_left = len(states[0].timesteps) - states[0].index
            self.cacher.start_step([s.serial for s in states], steps_left)
        # A batch shares its key, and so its adapter.
        self.adapters.apply(states[0].lora)
        main = self.pipe.transformer
        if (branch := self.branch) is not None and cfg:
            conditional, unconditional = branch.beside(
                lambda model: self._predict(model, [], cfg, branch.device),
                lambda: self._predict(main, states, [], self.device),
            )
            pred = torch.cat([conditional, unconditional.to(self.device)])
        else:
            pred = self._predict(main, states, cfg, self.device)
        reused = self.cacher is not None and self.cacher.reused_last_step()
        self.count_steps("reused" if reused else "computed", len(states))
        preds = list(torch.split(pred, [len(s.latents) for s in [*states, *cfg]]))
        uncond = dict(zip(map(id, cfg), preds[len(states) :], strict=True))
        for state, cond in zip(states, preds[: len(states)], strict=True):
            if (neg := uncond.get(id(state))) is not None:
                combined = neg + state.guidance * (cond - neg)
                # Rescaled to the conditional prediction's norm, as the pipeline does.
                cond = combined * (
                    torch.norm(cond, dim=-1, keepdim=True)
                    / torch.norm(combined, dim=-1, keepdim=True)
                )
            sigma, after = state.sigmas[state.index], state.sigmas[state.index + 1]
            step = state.latents.to(torch.float32) + (after - sigma) * cond
            state.latents = step.to(cond.dtype)
            state.index += 1
            state.reused += reused
        self.progress()
