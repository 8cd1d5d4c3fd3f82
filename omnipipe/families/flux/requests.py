"""FLUX.1's request fields on the image API (and Kontext's on the edit API): diffusers'
defaults where the client sent none (FluxPipeline's and FluxKontextPipeline's 28 steps
and guidance 3.5, not the image API's 50 and 4), and no negative prompt. Imported by the
router, so it stays light: no torch, no diffusers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omnipipe.api.families import RequestProblem

# FluxPipeline.__call__'s defaults. schnell is distilled to 1-4 steps and has no guidance
# input: its callers send num_inference_steps 4 (examples/flux1-schnell.yaml says so).
DEFAULT_STEPS, DEFAULT_GUIDANCE = 28, 3.5


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

    def chat_image_params(
        self, request: Mapping[str, Any], parse_size: Callable[[str], tuple[int, int]]
    ) -> dict[str, Any]:
        raise RequestProblem(
            "this pipeline makes images from a prompt: send it to POST /v1/images/generations"
        )


EXTENSIONS = FluxRequests()
