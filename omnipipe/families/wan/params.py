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
from omnipipe.stagekit.params import int_param, prompt_of
from omnipipe.stagekit.stage import StageInputError

# The UMT5 context WanPipeline.__call__ pads every prompt to (its encode_prompt says 226).
MAX_SEQUENCE_LENGTH = 512


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
    prompt = prompt_of(params)
    negative = params.get("negative_prompt") or ""
    if not isinstance(negative, str):
        raise StageInputError("negative_prompt must be a string")
    return VideoParams(
        prompt=prompt,
        negative_prompt=negative,
        width=int_param(params, "width", DEFAULT_WIDTH),
        height=int_param(params, "height", DEFAULT_HEIGHT),
        num_frames=int_param(params, "num_frames", DEFAULT_FRAMES),
        fps=int_param(params, "fps", DEFAULT_FPS),
        steps=int_param(params, "num_inference_steps", DEFAULT_STEPS),
        guidance=float(params.get("guidance_scale", DEFAULT_GUIDANCE)),
        seed=int_param(params, "seed", 0),
    )
