"""Wan's DiT denoiser as steps that requests share, reproducing WanPipeline's loop with
true CFG (within a stated tolerance, tests/unit/test_wan.py).

Each step is one transformer forward for the whole batch: every request's conditional
row and, under CFG, its unconditional row beside it, each at its own timestep. Rows of
one latent shape (size and frame count) batch; each request keeps its own scheduler,
since UniPC's multistep update remembers the request's earlier predictions.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnipipe.api.param_limits import ParamLimit
from omnipipe.families.wan.loading import geometry_limits, load_wan
from omnipipe.families.wan.params import MAX_SEQUENCE_LENGTH, video_params
from omnipipe.stagekit.stage import StageJob, StageResult, SteppedStage, check_param_limits


@dataclass
class Denoising:
    """One request in flight."""

    latents: torch.Tensor  # (1, channels, latent frames, height, width), float32
    text: torch.Tensor  # (1, context, dim)
    negative: torch.Tensor | None
    guidance: float
    scheduler: Any
    timesteps: torch.Tensor
    index: int = 0


def padded_context(embeds: torch.Tensor) -> torch.Tensor:
    """The encoder's tokens zero-padded to the context, as WanPipeline feeds them."""
    return torch.nn.functional.pad(embeds, (0, 0, 0, MAX_SEQUENCE_LENGTH - embeds.shape[1]))


class WanDenoiseStage(SteppedStage):
    """Flow-matching DiT denoising with true CFG over the two embeddings -> latents."""

    def load(self) -> None:
        self.pipe = load_wan(self.model_path, self.device, {"transformer", "scheduler"})
        self.max_side, self.max_frames = geometry_limits(self.pipe)
        self.limits = self._limits()

    def batch_key(self, job: StageJob) -> Hashable | None:
        video = video_params(job.params)
        return (video.width, video.height, video.num_frames)

    def begin(self, job: StageJob) -> Denoising:
        pipe, device = self.pipe, self.device
        video = video_params(job.params)
        check_param_limits(
            {"width": video.width, "height": video.height, "num_frames": video.num_frames},
            self.limits,
        )
        enc = job.inputs["encode"]
        dtype = pipe.transformer.dtype
        scheduler = copy.deepcopy(pipe.scheduler)
        scheduler.set_timesteps(video.steps, device=device)
        scheduler.set_begin_index(0)
        generator = torch.Generator(device="cpu").manual_seed(video.seed)
        latents = pipe.prepare_latents(
            1,
            pipe.transformer.config.in_channels,
            video.height,
            video.width,
            video.num_frames,
            torch.float32,
            device,
            generator,
        )
        negative = enc.get("negative_prompt_embeds")
        return Denoising(
            latents=latents,
            text=padded_context(enc["prompt_embeds"]).to(device, dtype),
            negative=None if negative is None else padded_context(negative).to(device, dtype),
            guidance=video.guidance,
            scheduler=scheduler,
            timesteps=scheduler.timesteps,
        )

    def param_limits(self) -> tuple[ParamLimit, ...]:
        return self.limits

    def _limits(self) -> tuple[ParamLimit, ...]:
        """Made once, at load. A size or length past the DiT's rotary positions: the
        client's 400 with the model's limit, from the router at once (and here, before
        any tensor is made), never torch's words from deep inside."""
        why = "this model's DiT places at most"
        side = f"{why} {self.max_side} pixels a side"
        return (
            ParamLimit(param="width", maximum=self.max_side, field="size", why=side),
            ParamLimit(param="height", maximum=self.max_side, field="size", why=side),
            ParamLimit(
                param="num_frames",
                maximum=self.max_frames,
                field="seconds",
                why=f"{why} {self.max_frames} frames",
            ),
        )

    def step_count(self, state: Denoising) -> tuple[int, int]:
        return state.index, len(state.timesteps)

    def finished(self, state: Denoising) -> bool:
        return state.index >= len(state.timesteps)

    def finish(self, state: Denoising) -> StageResult:
        return StageResult(tensors={"latents": state.latents})

    def step(self, states: Sequence[Denoising]) -> None:
        cfg = [s for s in states if s.negative is not None]
        rows = [*states, *cfg]
        transformer = self.pipe.transformer
        hidden = torch.cat([s.latents for s in rows]).to(transformer.dtype)
        times = torch.stack([s.timesteps[s.index] for s in rows])
        texts = [s.text for s in states] + [s.negative for s in cfg if s.negative is not None]
        with torch.inference_mode():
            pred: torch.Tensor = transformer(
                hidden_states=hidden,
                timestep=times,
                encoder_hidden_states=torch.cat(texts),
                return_dict=False,
            )[0]
        preds = list(torch.split(pred, 1))
        uncond = dict(zip(map(id, cfg), preds[len(states) :], strict=True))
        for state, cond in zip(states, preds[: len(states)], strict=True):
            if (neg := uncond.get(id(state))) is not None:
                cond = neg + state.guidance * (cond - neg)
            t = state.timesteps[state.index]
            state.latents = state.scheduler.step(cond, t, state.latents, return_dict=False)[0]
            state.index += 1
        self.count_steps("computed", len(states))
        self.progress()
