"""BAGEL's flow-matching sampler with its CFG over the text and the image conditions.

Noise is t=1, the image t=0. The timesteps are linspace(1, 0, steps) moved by the
timestep shift s: t' = s t / (1 + (s - 1) t). Within the CFG interval the velocity is
    v_text = v_no_text + cfg_text_scale (v - v_no_text)
    v_cfg  = v_no_image + cfg_img_scale (v_text - v_no_image)   (when an image conditions)
then renormalised ("global"): scaled back so its norm is at most v's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omnipipe.families.bagel.generator import BagelGenerator
from omnipipe.families.bagel.mot import ContextKV


@dataclass(frozen=True)
class FlowParams:
    height: int
    width: int
    steps: int = 50
    timestep_shift: float = 3.0
    cfg_text_scale: float = 4.0
    cfg_img_scale: float = 1.0
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_min: float = 0.0
    seed: int = 0

    @property
    def uses_text_cfg(self) -> bool:
        return self.cfg_text_scale > 1.0

    @property
    def uses_image_cfg(self) -> bool:
        return self.cfg_img_scale > 1.0


@dataclass(frozen=True)
class Conditions:
    """The context's cache and its CFG companions: the context without the text
    (needed when cfg_text_scale > 1) and without the input image (cfg_img_scale > 1)."""

    full: ContextKV
    no_text: ContextKV | None = None
    no_image: ContextKV | None = None


def timesteps(steps: int, shift: float) -> torch.Tensor:
    t = torch.linspace(1.0, 0.0, steps)
    return shift * t / (1 + (shift - 1) * t)


def initial_noise(generator: BagelGenerator, params: FlowParams) -> torch.Tensor:
    rows, cols = generator.latent_grid(params.height, params.width)
    # Drawn on the CPU whatever the device, so a seed gives the same image everywhere.
    rng = torch.Generator(device="cpu").manual_seed(params.seed)
    noise = torch.randn(rows * cols, generator.config.patch_dim, generator=rng)
    return noise.to(generator.vae2llm.weight.device)


def denoise(
    generator: BagelGenerator,
    conditions: Conditions,
    params: FlowParams,
    markers: tuple[int, int],
    on_step: Callable[[], None] = lambda: None,
    cancelled: threading.Event | None = None,
) -> torch.Tensor:
    """Latent tokens (tokens, patch_dim) of the image, float32."""
    if params.uses_text_cfg and conditions.no_text is None:
        raise ValueError("cfg_text_scale > 1 needs the context without the text")
    if params.uses_image_cfg and conditions.no_image is None:
        raise ValueError("cfg_img_scale > 1 needs the context without the input image")
    rows, cols = generator.latent_grid(params.height, params.width)
    ids = generator.position_ids(rows, cols)
    x = initial_noise(generator, params)
    ts = timesteps(params.steps, params.timestep_shift)
    low, high = params.cfg_interval
    with torch.inference_mode():
        for i in range(len(ts) - 1):
            if cancelled is not None and cancelled.is_set():
                break
            t = float(ts[i])
            v = generator.velocity(x, t, ids, conditions.full, markers).float()
            if low < t <= high:
                v = guided(generator, x, t, ids, v, conditions, params, markers)
            x = x - v * float(ts[i] - ts[i + 1])
            on_step()
    return x


def guided(
    generator: BagelGenerator,
    x: torch.Tensor,
    t: float,
    ids: torch.Tensor,
    v: torch.Tensor,
    conditions: Conditions,
    params: FlowParams,
    markers: tuple[int, int],
) -> torch.Tensor:
    out = v
    if params.uses_text_cfg:
        assert conditions.no_text is not None
        v_text = generator.velocity(x, t, ids, conditions.no_text, markers).float()
        out = v_text + params.cfg_text_scale * (v - v_text)
    if params.uses_image_cfg:
        assert conditions.no_image is not None
        v_img = generator.velocity(x, t, ids, conditions.no_image, markers).float()
        out = v_img + params.cfg_img_scale * (out - v_img)
    if out is v:
        return v
    scale = (v.norm() / (out.norm() + 1e-8)).clamp(min=params.cfg_renorm_min, max=1.0)
    renormed: torch.Tensor = out * scale
    return renormed
