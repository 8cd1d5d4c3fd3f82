"""diffusers-video's request fields: a /v1/videos request as the whole pipeline's call
arguments. The router needs the video's size, length and rate before a job exists (the
job shows them and the work bound reads them), so what a request leaves out of those is
CogVideoX's, the model the type is shown with: 720x480, 49 frames at 8 fps (6 s, its
released clips). Steps and guidance left out stay None: the stage leaves them to the
pipeline's own defaults (CogVideoX's 50 at 6), as the image fallback does. Imported by
the router, so it stays light: no torch, no diffusers."""

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

# A VAE 8x down and a DiT's 2x2 patches (CogVideoX's, Wan's, HunyuanVideo's, Mochi's);
# the largest side is CogVideoX 1.5's 1360x768.
SIDE_MULTIPLE, MIN_SIDE, MAX_SIDE = 16, 16, 1360
# 8k+1 frames: CogVideoX's VAE is 4x in time but decodes its latent frames two at a time
# after the first, so an even count of latent frames (4k+1 frames with k odd) comes out
# as more frames than asked; LTX-Video's VAE is 8x in time. 8k+1 is also 4k+1 (Wan's,
# HunyuanVideo's).
FRAME_STEP, MAX_FRAMES = 8, 257
MAX_FPS = 60
# As the prompt's own bound (the router's request model).
MAX_PROMPT_CHARS = 32_000
DEFAULT_WIDTH, DEFAULT_HEIGHT, DEFAULT_FPS, DEFAULT_SECONDS = 720, 480, 8, 6.0
DEFAULT_SIZE = f"{DEFAULT_WIDTH}x{DEFAULT_HEIGHT}"
MAX_STEPS, MAX_GUIDANCE = 200, 50.0
# The work a job may ask, in latent tokens (what the DiT attends over and the VAE
# decodes: a 16x16-pixel patch of 4 frames, the first frame alone) and in tokens times
# steps (the DiT's time), so that sides and a length each inside their bounds cannot
# together ask for hours of GPU time. The bounds are CogVideoX 1.5's largest size at
# twice its 81 frames, and that at 50 steps.
PATCH_PIXELS, LATENT_FRAME_STEP = 16, 4


def latent_tokens(width: int, height: int, frames: int) -> int:
    return (
        (width // PATCH_PIXELS) * (height // PATCH_PIXELS) * ((frames - 1) // LATENT_FRAME_STEP + 1)
    )


MAX_LATENT_TOKENS = latent_tokens(1360, 768, 161)
# The token bound at 50 steps, the default of nearly every diffusers video pipeline
# (CogVideoX's, Wan's, HunyuanVideo's, LTX's): a job that leaves its steps to the
# pipeline is bounded by its tokens alone.
MAX_TOKEN_STEPS = MAX_LATENT_TOKENS * 50


def frames_for(seconds: float, fps: int) -> int:
    """The nearest 8k+1 frames to a duration."""
    return FRAME_STEP * round(seconds * fps / FRAME_STEP) + 1


def _frames(request: Mapping[str, Any], fps: int) -> int:
    if given(request, "num_frames"):
        frames = integer_field(request, "num_frames", 1, MAX_FRAMES)
        if (frames - 1) % FRAME_STEP:
            raise RequestProblem(
                f"num_frames must be {FRAME_STEP}k+1 (1, 9, 17, ... {MAX_FRAMES}), got {frames}",
                "num_frames",
            )
        return frames
    if not given(request, "seconds"):
        return frames_for(DEFAULT_SECONDS, fps)
    return frames_for(number_field(request, "seconds", 1 / fps, (MAX_FRAMES - 1) / fps), fps)


def _check_work(
    request: Mapping[str, Any], width: int, height: int, frames: int, steps: int | None
) -> None:
    """A 400 naming the bound, before a job is made."""
    tokens = latent_tokens(width, height, frames)
    length = "num_frames" if given(request, "num_frames") else "seconds"
    if tokens > MAX_LATENT_TOKENS:
        raise RequestProblem(
            f"{width}x{height} at {frames} frames is {tokens:,} latent tokens, past the limit "
            f"of {MAX_LATENT_TOKENS:,} (1360x768 at 161 frames): ask for fewer frames or a "
            "smaller size",
            length,
        )
    if steps is not None and tokens * steps > MAX_TOKEN_STEPS:
        most = MAX_TOKEN_STEPS // tokens
        raise RequestProblem(
            f"num_inference_steps {steps} at {width}x{height} and {frames} frames is "
            f"{tokens * steps:,} token-steps, past the limit of {MAX_TOKEN_STEPS:,} (1360x768 "
            f"at 161 frames and 50 steps): this size and length take at most {most} steps",
            "num_inference_steps",
        )


class DiffusersVideoRequests(TextToVideoRequests):
    def video_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The stage's parameters for a video request (prompt and seed are the router's);
        None: the pipeline's own default."""
        width, height = size_field(request, DEFAULT_SIZE, SIDE_MULTIPLE, MIN_SIDE, MAX_SIDE)
        fps = integer_field(request, "fps", 1, MAX_FPS) if given(request, "fps") else DEFAULT_FPS
        negative = text_field(request, "negative_prompt", MAX_PROMPT_CHARS)
        frames = _frames(request, fps)
        steps = None
        if given(request, "num_inference_steps"):
            steps = integer_field(request, "num_inference_steps", 1, MAX_STEPS)
        guidance = None
        if given(request, "guidance_scale"):
            guidance = number_field(request, "guidance_scale", 0, MAX_GUIDANCE)
        _check_work(request, width, height, frames, steps)
        return {
            "width": width,
            "height": height,
            "fps": fps,
            "num_frames": frames,
            "num_inference_steps": steps,
            "guidance_scale": guidance,
            "negative_prompt": negative,
        }


EXTENSIONS = DiffusersVideoRequests()
