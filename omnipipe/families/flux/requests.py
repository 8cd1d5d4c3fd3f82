"""FLUX.1's request fields on the image API (and Kontext's on the edit API): diffusers'
defaults where the client sent none (FluxPipeline's and FluxKontextPipeline's 28 steps
and guidance 3.5, not the image API's 50 and 4), no negative prompt, and the size of a
masked Kontext edit (its input's trained size, as FluxKontextInpaintPipeline makes it).
Imported by the router, so it stays light: no torch, no diffusers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omnipipe.api.families import RequestProblem

# FluxPipeline.__call__'s defaults. schnell is distilled to 1-4 steps and has no guidance
# input: its callers send num_inference_steps 4 (examples/flux1-schnell.yaml says so).
DEFAULT_STEPS, DEFAULT_GUIDANCE = 28, 3.5
# diffusers' PREFERRED_KONTEXT_RESOLUTIONS (pipeline_flux_kontext.py), the (width, height)
# Kontext was trained at; copied so that the router need not import diffusers
# (tests/unit/test_flux_kontext_mask.py holds the two equal).
KONTEXT_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248),
    (880, 1184), (944, 1104), (1024, 1024), (1104, 944), (1184, 880), (1248, 832),
    (1328, 800), (1392, 752), (1456, 720), (1504, 688), (1568, 672),
)  # fmt: skip
# FLUX.1's VAE is 8x down and its DiT packs 2x2 latents: sides are multiples of 16.
KONTEXT_MULTIPLE = 16


def kontext_size(width: int, height: int, multiple: int = KONTEXT_MULTIPLE) -> tuple[int, int]:
    """The trained (width, height) Kontext encodes an input of width x height at, as
    FluxKontextPipeline picks it: each side down to `multiple`, then the trained size of
    the nearest aspect ratio (its sides down to `multiple`)."""
    ratio = (width - width % multiple) / (height - height % multiple)
    _, w, h = min((abs(ratio - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    return w // multiple * multiple, h // multiple * multiple


class FluxRequests:
    chat_makes_images = False

    def image_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        if request.get("negative_prompt"):
            raise RequestProblem(
                "FLUX.1 takes no negative prompt: its guidance is distilled into the model "
                "(guidance_scale, 3.5 by default)",
                "negative_prompt",
            )
        params: dict[str, Any] = {}
        if request.get("num_inference_steps") is None:
            params["num_inference_steps"] = DEFAULT_STEPS
        if request.get("guidance_scale") is None:
            params["guidance_scale"] = DEFAULT_GUIDANCE
        return params

    def edit_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Kontext's, on /v1/images/edits: FluxKontextPipeline's defaults are dev's."""
        return self.image_params(request)

    def masked_edit_size(self, width: int, height: int) -> tuple[int, int]:
        """A masked Kontext edit is made at its input's trained size: the noise's latents
        are blended with the input's (FluxKontextInpaintPipeline sets its output size so)."""
        if min(width, height) < KONTEXT_MULTIPLE:
            raise RequestProblem(
                f"image: a masked edit needs an input of at least {KONTEXT_MULTIPLE} pixels a "
                f"side, got {width}x{height}",
                "image",
            )
        return kontext_size(width, height)

    def chat_image_params(
        self, request: Mapping[str, Any], parse_size: Callable[[str], tuple[int, int]]
    ) -> dict[str, Any]:
        raise RequestProblem(
            "this pipeline makes images from a prompt: send it to POST /v1/images/generations"
        )


EXTENSIONS = FluxRequests()
