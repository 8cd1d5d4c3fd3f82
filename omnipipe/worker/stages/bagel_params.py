"""A BAGEL request's image parameters, checked where the stages read them."""

from __future__ import annotations

from typing import Any

from omnipipe.worker.bagel.flow import FlowParams
from omnipipe.worker.stages.base import StageInputError

MAX_STEPS = 200


def cfg_scale(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise StageInputError(f"{key} must be a number >= 0")
    return float(value)


def int_param(params: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise StageInputError(f"{key} must be an integer from {low} to {high}")
    return value


def flow_params(params: dict[str, Any], index: int = 0) -> FlowParams:
    """A request's sampling for its index-th image (seed + index)."""
    interval = params.get("cfg_interval", (0.4, 1.0))
    if (
        not isinstance(interval, (list, tuple))
        or len(interval) != 2
        or not all(isinstance(x, (int, float)) and 0 <= x <= 1 for x in interval)
    ):
        raise StageInputError("cfg_interval must be two numbers in [0, 1]")
    shift = cfg_scale(params, "timestep_shift", 3.0)
    if shift <= 0:
        raise StageInputError("timestep_shift must be > 0")
    return FlowParams(
        height=int_param(params, "height", 1024, 16, 2048),
        width=int_param(params, "width", 1024, 16, 2048),
        steps=int_param(params, "num_inference_steps", 50, 2, MAX_STEPS),
        timestep_shift=shift,
        cfg_text_scale=cfg_scale(params, "cfg_text_scale", 4.0),
        cfg_img_scale=cfg_scale(params, "cfg_img_scale", 1.0),
        cfg_interval=(float(interval[0]), float(interval[1])),
        cfg_renorm_min=cfg_scale(params, "cfg_renorm_min", 0.0),
        seed=int_param(params, "seed", 0, 0, 2**63 - 1) + index,
    )
