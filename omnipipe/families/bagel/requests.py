"""BAGEL's request extensions, shared by /v1/images/generations and /v1/chat/completions
(`extra_body` in the openai client):

- cfg_text_scale (default 4.0, 1 to 20; on /v1/images/generations, guidance_scale when
  not given): CFG over the text; above 1 the think stage also hands over the cache of the
  context without its text. negative_prompt is refused: there is none in BAGEL's CFG.
- cfg_img_scale (default 1.0, 1 to 20): CFG over the input image(s); above 1 (with an
  image in the conversation) the cache of the context without its images comes too.
- cfg_interval (default [0.4, 1.0], 0 <= start < end <= 1): the timesteps (1 is noise)
  CFG applies at.
- cfg_renorm_min (default 0.0, 0 to 1): the least the CFG velocity's renormalisation may
  scale.
- timestep_shift (default 3.0, 1 to 10): moves the flow's timesteps toward the noise end.
- In chat only: size ("WIDTHxHEIGHT"), num_inference_steps (2 to 200), for the image.

omnipipe/families/bagel/ranges.py says why each range is what it is; a value outside one is a 400
naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnipipe.api.families import RequestProblem
from omnipipe.families.bagel.ranges import (
    DEFAULT_CFG_INTERVAL,
    MAX_STEPS,
    MIN_STEPS,
    SCALAR_RANGES,
    interval_problem,
    scalar_problem,
)

# The image API's defaults (router/api/images.py), which BAGEL keeps where the client
# sent none: its steps, and its guidance as the text CFG scale.
IMAGE_API_STEPS, IMAGE_API_GUIDANCE = 50, 4.0


class BagelChatImageOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    size: str = "1024x1024"
    num_inference_steps: int = Field(default=50, ge=MIN_STEPS, le=MAX_STEPS)


def bagel_image_params(
    extra: Mapping[str, Any] | None, given_as: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The CFG and flow extensions of an image request, checked. given_as names the
    request field a value came from when it is not the extension's own (guidance_scale
    for cfg_text_scale), so the 400 names what the client sent."""
    extra = extra or {}
    params: dict[str, Any] = {}
    for key, (_, _, default) in SCALAR_RANGES.items():
        value = extra.get(key, default)
        if (problem := scalar_problem(key, value)) is not None:
            param = (given_as or {}).get(key, key)
            message = problem if param == key else f"{param} (BAGEL's {problem})"
            raise RequestProblem(message, param=param)
        params[key] = float(value)
    interval = extra.get("cfg_interval", list(DEFAULT_CFG_INTERVAL))
    if (problem := interval_problem(interval)) is not None:
        raise RequestProblem(problem, param="cfg_interval")
    params["cfg_interval"] = [float(interval[0]), float(interval[1])]
    return params


def bagel_chat_image_params(
    extra: Mapping[str, Any] | None, parse_size: Callable[[str], tuple[int, int]]
) -> dict[str, Any]:
    """A chat request's image: its size and steps beside the CFG extensions."""
    try:
        options = BagelChatImageOptions.model_validate(extra or {})
    except ValidationError as exc:
        error = exc.errors(include_input=False)[0]
        where = ".".join(str(p) for p in error["loc"])
        raise RequestProblem(f"{where}: {error['msg']}", param=where) from None
    width, height = parse_size(options.size)
    return {
        **bagel_image_params(extra),
        "width": width,
        "height": height,
        "num_inference_steps": options.num_inference_steps,
    }


class BagelRequests:
    """BAGEL's request extensions (omnipipe.api.families.RequestExtensions)."""

    chat_makes_images = True

    def image_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        if request.get("negative_prompt"):
            # BAGEL's text CFG runs against the context without its text.
            raise RequestProblem(
                "BAGEL takes no negative_prompt: its text CFG (cfg_text_scale) is "
                "against the context without the prompt",
                param="negative_prompt",
            )
        if request.get("num_inference_steps", IMAGE_API_STEPS) < MIN_STEPS:
            raise RequestProblem(
                f"num_inference_steps: BAGEL's flow takes at least {MIN_STEPS}",
                param="num_inference_steps",
            )
        # guidance_scale is the text CFG scale unless cfg_text_scale says otherwise.
        extra = dict(request)
        given_as = {} if "cfg_text_scale" in extra else {"cfg_text_scale": "guidance_scale"}
        extra.setdefault("cfg_text_scale", request.get("guidance_scale", IMAGE_API_GUIDANCE))
        return bagel_image_params(extra, given_as)

    def chat_image_params(
        self, request: Mapping[str, Any], parse_size: Callable[[str], tuple[int, int]]
    ) -> dict[str, Any]:
        return bagel_chat_image_params(request, parse_size)


EXTENSIONS = BagelRequests()
