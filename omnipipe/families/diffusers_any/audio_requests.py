"""diffusers-audio's request fields: a /v1/audio/generate body as its stage's parameters,
within the bounds a request may ask of the pipeline. What the client leaves out keeps
the pipeline's own defaults (AudioLDM's 5.12 s at 10 steps and guidance 2.5). Imported
by the router, so it stays light: no torch, no diffusers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from omnipipe.api.families import RequestProblem
from omnipipe.api.plain_text import shown

ELSEWHERE = "this pipeline makes audio: send the prompt to POST /v1/audio/generate"
# The longest clip a request may ask for: Stable Audio Open's 47 s, the model vLLM-Omni
# serves at this endpoint. AudioLDM's checkpoints, trained on 10 s clips, make longer ones
# (their UNet is convolutional) at a cost that grows with the length.
MAX_AUDIO_SECONDS = 47.0
# As the image API's: a denoiser's steps past this change little and hold the GPU long.
MAX_STEPS = 200
MAX_GUIDANCE = 50.0
# The CFG of these pipelines runs above guidance 1 (AudioLDM's `guidance_scale > 1`):
# at or below it a negative prompt would be ignored unsaid.
CFG_ABOVE = 1.0
MAX_PROMPT_CHARS = 32_000


def _number(
    request: Mapping[str, Any], key: str, low: float, high: float, above: bool = False
) -> float | None:
    """The field as a number from low (above it, where `above`) to high, or None where
    the client left it out."""
    value = request.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestProblem(f"{key} must be a number, got {shown(value)}", key)
    inside = low < value if above else low <= value
    if not math.isfinite(value) or not inside or value > high:
        bound = f"above {low:g} and at most" if above else f"from {low:g} to"
        raise RequestProblem(f"{key} must be {bound} {high:g}, got {shown(value)}", key)
    return float(value)


def _steps(request: Mapping[str, Any]) -> int | None:
    value = request.get("num_inference_steps")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STEPS:
        raise RequestProblem(
            f"num_inference_steps must be an integer from 1 to {MAX_STEPS}, got {shown(value)}",
            "num_inference_steps",
        )
    return value


def _negative(request: Mapping[str, Any]) -> str | None:
    negative = request.get("negative_prompt")
    if negative is None or negative == "":
        return None
    if not isinstance(negative, str):
        raise RequestProblem("negative_prompt must be a string", "negative_prompt")
    if len(negative) > MAX_PROMPT_CHARS:
        raise RequestProblem(
            f"negative_prompt: at most {MAX_PROMPT_CHARS} characters, got {len(negative)}",
            "negative_prompt",
        )
    return negative


class DiffusersAudioRequests:
    chat_makes_images = False

    def image_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        raise RequestProblem(ELSEWHERE)

    def chat_image_params(
        self, request: Mapping[str, Any], parse_size: Callable[[str], tuple[int, int]]
    ) -> dict[str, Any]:
        raise RequestProblem(ELSEWHERE)

    def audio_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The stage's parameters for a /v1/audio/generate request (its prompt, seed and
        format are the router's); None leaves a setting to the pipeline."""
        start = request.get("audio_start")
        if start is not None and start != 0:
            raise RequestProblem(
                f"audio_start: this pipeline makes audio from its start; leave it out or "
                f"send 0, got {shown(start)}",
                "audio_start",
            )
        guidance = _number(request, "guidance_scale", 0.0, MAX_GUIDANCE)
        negative = _negative(request)
        if negative is not None and guidance is not None and guidance <= CFG_ABOVE:
            raise RequestProblem(
                f"guidance_scale: with a negative_prompt it must be above {CFG_ABOVE:g} (the "
                f"pipeline's CFG runs only there), got {guidance:g}",
                "guidance_scale",
            )
        return {
            "audio_length": _number(request, "audio_length", 0.0, MAX_AUDIO_SECONDS, above=True),
            "num_inference_steps": _steps(request),
            "guidance_scale": guidance,
            "negative_prompt": negative,
        }


EXTENSIONS = DiffusersAudioRequests()
