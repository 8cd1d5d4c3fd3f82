"""A video request's stage parameters, as the router sends them to every Wan stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnipipe.families.wan.requests import (
    DEFAULT_FPS,
    DEFAULT_FRAMES,
    DEFAULT_GUIDANCE,
    DEFAULT_HEIGHT,
    DEFAULT_STEPS,
    DEFAULT_WIDTH,
)
from omnipipe.stagekit.stage import StageInputError

# The UMT5 context WanPipeline.__call__ pads every prompt to (its encode_prompt says 226).
MAX_SEQUENCE_LENGTH = 512


def _int(params: dict[str, Any], key: str, default: int) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise StageInputError(f"{key} must be an integer")
    return value


@dataclass(frozen=True)
class VideoParams:
    prompt: str
    negative_prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    steps: int
    guidance: float
    seed: int

    @property
    def cfg(self) -> bool:
        """True CFG runs above 1, as WanPipeline's do_classifier_free_guidance."""
        return self.guidance > 1.0


def video_params(params: dict[str, Any]) -> VideoParams:
    prompt = params.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise StageInputError("prompt must be a non-empty string")
    negative = params.get("negative_prompt") or ""
    if not isinstance(negative, str):
        raise StageInputError("negative_prompt must be a string")
    return VideoParams(
        prompt=prompt,
        negative_prompt=negative,
        width=_int(params, "width", DEFAULT_WIDTH),
        height=_int(params, "height", DEFAULT_HEIGHT),
        num_frames=_int(params, "num_frames", DEFAULT_FRAMES),
        fps=_int(params, "fps", DEFAULT_FPS),
        steps=_int(params, "num_inference_steps", DEFAULT_STEPS),
        guidance=float(params.get("guidance_scale", DEFAULT_GUIDANCE)),
        seed=_int(params, "seed", 0),
    )
