"""FLUX.2's request fields on the image API (and its edits' on the edit API): diffusers'
defaults where the client sent none (Flux2Pipeline's and Flux2KleinPipeline's 50 steps
and guidance 4). A negative prompt is the checkpoint's to take or refuse: klein's base
checkpoints run CFG with one, dev and the step-distilled klein refuse it by name in their
encode stage (this family's pipeline types share these extensions, and only the loaded
checkpoint knows which it is). Imported by the router, so it stays light: no torch, no
diffusers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omnipipe.api.families import RequestProblem

# Flux2Pipeline.__call__'s and Flux2KleinPipeline.__call__'s defaults alike. The
# step-distilled klein is made for 4 steps: examples/flux2-klein.yaml says so.
DEFAULT_STEPS, DEFAULT_GUIDANCE = 50, 4.0


class Flux2Requests:
    chat_makes_images = False

    def image_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if request.get("num_inference_steps") is None:
            params["num_inference_steps"] = DEFAULT_STEPS
        if request.get("guidance_scale") is None:
            params["guidance_scale"] = DEFAULT_GUIDANCE
        return params

    def edit_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """An edit's, on /v1/images/edits: the pipelines take `image=` with the same
        defaults."""
        return self.image_params(request)

    def chat_image_params(
        self, request: Mapping[str, Any], parse_size: Callable[[str], tuple[int, int]]
    ) -> dict[str, Any]:
        raise RequestProblem(
            "this pipeline makes images from a prompt: send it to POST /v1/images/generations"
        )


EXTENSIONS = Flux2Requests()
