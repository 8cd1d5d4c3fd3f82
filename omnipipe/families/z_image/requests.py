"""Z-Image's request fields on the image API: diffusers' defaults where the client sent
none (ZImagePipeline.__call__'s 50 steps and guidance 5.0, not the image API's 50 and 4;
Turbo's callers send its 8 steps and guidance 0, as examples/z-image-turbo.yaml says),
the pipeline's two CFG options (cfg_normalization, cfg_truncation), and no negative
prompt without CFG. Imported by the router, so it stays light: no torch, no diffusers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omnipipe.api.families import RequestProblem

# ZImagePipeline.__call__'s defaults: the base model's CFG. Turbo is distilled to about 8
# steps without CFG (guidance_scale 0).
DEFAULT_STEPS, DEFAULT_GUIDANCE = 50, 5.0
CFG_OPTIONS = ("cfg_normalization", "cfg_truncation")


def _cfg_option(request: Mapping[str, Any], name: str) -> float:
    value = request[name]
    # cfg_normalization is a bool or a factor in the pipeline: True is 1.
    if name == "cfg_normalization" and isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise RequestProblem(f"{name} must be a number, 0 or more", name)
    return float(value)


class ZImageRequests:
    chat_makes_images = False
    # ZImagePipeline runs its CFG at any guidance above 0 (pos + g * (pos - neg)).
    cfg_guidance_above = 0.0

    def image_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = {}
        guidance = request.get("guidance_scale")
        if guidance is None:
            guidance = params["guidance_scale"] = DEFAULT_GUIDANCE
        if request.get("num_inference_steps") is None:
            params["num_inference_steps"] = DEFAULT_STEPS
        unguided = isinstance(guidance, int | float) and guidance <= 0
        if unguided and request.get("negative_prompt"):
            raise RequestProblem(
                "negative_prompt: Z-Image uses it only under CFG, with guidance_scale above 0 "
                "(Turbo runs at 0, without CFG)",
                "negative_prompt",
            )
        for name in CFG_OPTIONS:
            if request.get(name) is None:
                continue
            if unguided:
                raise RequestProblem(
                    f"{name}: applies only under CFG, with guidance_scale above 0", name
                )
            params[name] = _cfg_option(request, name)
        return params

    def chat_image_params(
        self, request: Mapping[str, Any], parse_size: Callable[[str], tuple[int, int]]
    ) -> dict[str, Any]:
        raise RequestProblem(
            "this pipeline makes images from a prompt: send it to POST /v1/images/generations"
        )


EXTENSIONS = ZImageRequests()
