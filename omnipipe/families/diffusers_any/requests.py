"""The diffusers fallback's request fields on the image API: where the client sent no
num_inference_steps or guidance_scale, the pipeline's own defaults (Stable Diffusion 3's
28 steps at 7.0, Sana's 20 at 4.5), not the image API's 50 and 4. Imported by the router,
so it stays light: no torch, no diffusers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omnipipe.api.families import RequestProblem

# Left to the pipeline's __call__ defaults when the client did not set them.
PIPELINE_DEFAULTED = ("num_inference_steps", "guidance_scale")


class DiffusersRequests:
    chat_makes_images = False

    def image_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        # None: the stage leaves the argument out of the pipeline's call.
        return {key: None for key in PIPELINE_DEFAULTED if request.get(key) is None}

    def chat_image_params(
        self, request: Mapping[str, Any], parse_size: Callable[[str], tuple[int, int]]
    ) -> dict[str, Any]:
        raise RequestProblem(
            "this pipeline makes images from a prompt: send it to POST /v1/images/generations"
        )


EXTENSIONS = DiffusersRequests()
