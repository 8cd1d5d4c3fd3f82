"""A /v1/videos request as Wan's stage parameters, checked against what the model
takes: sides that are multiples of 16 (the VAE's 8x and the DiT's 2x2 patches), and a
frame count of 4k+1 (the VAE packs 4 frames into one latent after the first). Imported
by the router, so it stays light: no torch, no diffusers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnipipe.api.families import RequestProblem
from omnipipe.api.request_fields import (
    TextToVideoRequests,
    given,
    integer_field,
    number_field,
    size_field,
    text_field,
)

SIDE_MULTIPLE, MIN_SIDE, MAX_SIDE = 16, 16, 1280
FRAME_STEP, MAX_FRAMES = 4, 257
MAX_FPS = 60
# As the prompt's own bound (the router's request model).
MAX_PROMPT_CHARS = 32_000
# WanPipeline's defaults, what a request leaves out gets: 832x480, 5 s at 16 fps (81
# frames), 50 steps, guidance 5.
DEFAULT_WIDTH, DEFAULT_HEIGHT, DEFAULT_FPS, DEFAULT_SECONDS = 832, 480, 16, 5.0
DEFAULT_SIZE = f"{DEFAULT_WIDTH}x{DEFAULT_HEIGHT}"
DEFAULT_STEPS, DEFAULT_GUIDANCE = 50, 5.0
MAX_STEPS = 200
# The work a job may ask of the stages, in latent tokens (what the DiT attends over and
# the VAE decodes: a 16x16-pixel patch of 4 frames, the first frame alone) and in tokens
# times steps (the denoiser's time). Inside the side and frame bounds a request could ask
# 416,000 tokens at 200 steps: hours of GPU time, and a decode stage holding 5 GB of
# float32 frames several times over (about 18 GB), with the job timeout the only stop.
# The bounds are 1280x720 at 161 frames, and that at 50 steps: 832x480 reaches 257
# frames, and the default 832x480 at 81 frames its 200 steps.
PATCH_PIXELS = 16
MAX_LATENT_TOKENS = (1280 // PATCH_PIXELS) * (720 // PATCH_PIXELS) * ((161 - 1) // FRAME_STEP + 1)
MAX_TOKEN_STEPS = MAX_LATENT_TOKENS * 50


def frames_for(seconds: float, fps: int) -> int:
    """The nearest 4k+1 frames to a duration."""
    return FRAME_STEP * round(seconds * fps / FRAME_STEP) + 1


DEFAULT_FRAMES = frames_for(DEFAULT_SECONDS, DEFAULT_FPS)


def _number(request: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    return number_field(request, key, low, high) if given(request, key) else default


def _integer(request: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    return integer_field(request, key, low, high) if given(request, key) else default


def _frames(request: Mapping[str, Any], fps: int) -> int:
    if request.get("num_frames") not in (None, ""):
        frames = _integer(request, "num_frames", 0, 1, MAX_FRAMES)
        if (frames - 1) % FRAME_STEP:
            raise RequestProblem(
                f"num_frames must be {FRAME_STEP}k+1 (1, 5, 9, ... {MAX_FRAMES}), got {frames}",
                "num_frames",
            )
        return frames
    longest = (MAX_FRAMES - 1) / fps
    seconds = _number(request, "seconds", DEFAULT_SECONDS, 1 / fps, longest)
    return frames_for(seconds, fps)


def latent_tokens(width: int, height: int, frames: int) -> int:
    return (width // PATCH_PIXELS) * (height // PATCH_PIXELS) * ((frames - 1) // FRAME_STEP + 1)


def _check_work(
    request: Mapping[str, Any], width: int, height: int, frames: int, steps: int
) -> None:
    """A 400 naming the bound, before a job is made: the size and length each inside
    their own bounds may still ask for more than a job may take."""
    tokens = latent_tokens(width, height, frames)
    length = "num_frames" if request.get("num_frames") not in (None, "") else "seconds"
    if tokens > MAX_LATENT_TOKENS:
        raise RequestProblem(
            f"{width}x{height} at {frames} frames is {tokens:,} latent tokens, past the limit "
            f"of {MAX_LATENT_TOKENS:,} (1280x720 at 161 frames): ask for fewer frames or a "
            "smaller size",
            length,
        )
    if tokens * steps > MAX_TOKEN_STEPS:
        most = MAX_TOKEN_STEPS // tokens
        raise RequestProblem(
            f"num_inference_steps {steps} at {width}x{height} and {frames} frames is "
            f"{tokens * steps:,} token-steps, past the limit of {MAX_TOKEN_STEPS:,} (1280x720 "
            f"at 161 frames and 50 steps): this size and length take at most {most} steps",
            "num_inference_steps",
        )


class WanRequests(TextToVideoRequests):
    def video_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The stages' parameters for a video request (prompt and seed are the router's)."""
        width, height = size_field(request, DEFAULT_SIZE, SIDE_MULTIPLE, MIN_SIDE, MAX_SIDE)
        fps = _integer(request, "fps", DEFAULT_FPS, 1, MAX_FPS)
        negative = text_field(request, "negative_prompt", MAX_PROMPT_CHARS)
        frames = _frames(request, fps)
        steps = _integer(request, "num_inference_steps", DEFAULT_STEPS, 1, MAX_STEPS)
        _check_work(request, width, height, frames, steps)
        return {
            "width": width,
            "height": height,
            "fps": fps,
            "num_frames": frames,
            "num_inference_steps": steps,
            "guidance_scale": _number(request, "guidance_scale", DEFAULT_GUIDANCE, 0, 50),
            "negative_prompt": negative,
        }


EXTENSIONS = WanRequests()
