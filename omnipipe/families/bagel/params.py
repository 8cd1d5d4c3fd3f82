"""A BAGEL request's image parameters, checked where the stages read them."""

from __future__ import annotations

from typing import Any

from omnipipe.families.bagel.flow import FlowParams
from omnipipe.families.bagel.ranges import (
    DEFAULT_CFG_INTERVAL,
    MAX_STEPS,
    MIN_STEPS,
    SCALAR_RANGES,
    interval_problem,
    scalar_problem,
)
from omnipipe.stagekit.stage import StageInputError

# The stage params that come from a request field of another name.
REQUEST_FIELD = {"width": "size", "height": "size"}


def cfg_scale(params: dict[str, Any], key: str, default: float | None = None) -> float:
    """One of BAGEL's scalar extensions (omnipipe/families/bagel/ranges.py), within its range."""
    value = params.get(key, SCALAR_RANGES[key][2] if default is None else default)
    if (problem := scalar_problem(key, value)) is not None:
        raise StageInputError(problem, param=key)
    return float(value)


def int_param(params: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise StageInputError(
            f"{key} must be an integer from {low} to {high}", param=REQUEST_FIELD.get(key, key)
        )
    return value


def flow_params(params: dict[str, Any], index: int = 0) -> FlowParams:
    """A request's sampling for its index-th image (seed + index)."""
    interval = params.get("cfg_interval", DEFAULT_CFG_INTERVAL)
    if (problem := interval_problem(interval)) is not None:
        raise StageInputError(problem, param="cfg_interval")
    return FlowParams(
        height=int_param(params, "height", 1024, 16, 2048),
        width=int_param(params, "width", 1024, 16, 2048),
        steps=int_param(params, "num_inference_steps", 50, MIN_STEPS, MAX_STEPS),
        timestep_shift=cfg_scale(params, "timestep_shift"),
        cfg_text_scale=cfg_scale(params, "cfg_text_scale"),
        cfg_img_scale=cfg_scale(params, "cfg_img_scale"),
        cfg_interval=(float(interval[0]), float(interval[1])),
        cfg_renorm_min=cfg_scale(params, "cfg_renorm_min"),
        seed=int_param(params, "seed", 0, 0, 2**63 - 1) + index,
    )
