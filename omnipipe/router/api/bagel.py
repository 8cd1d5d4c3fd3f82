"""BAGEL's request extensions, shared by /v1/images/generations and /v1/chat/completions
(`extra_body` in the openai client):

- cfg_text_scale (default 4.0; on /v1/images/generations, guidance_scale when not
  given): CFG over the text; above 1 the think stage also hands over the cache of the
  context without its text. negative_prompt is refused: there is none in BAGEL's CFG.
- cfg_img_scale (default 1.0): CFG over the input image(s); above 1 (with an image in the
  conversation) the cache of the context without its images comes too.
- cfg_interval (default [0.4, 1.0]): the timesteps (1 is noise) CFG applies at.
- cfg_renorm_min (default 0.0): the least the CFG velocity's renormalisation may scale.
- timestep_shift (default 3.0): moves the flow's timesteps toward the noise end.
- In chat only: size ("WIDTHxHEIGHT"), num_inference_steps, for the image.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnipipe.api import ResolvedPipeline
from omnipipe.router.errors import BadRequest

PIPELINE = "bagel"


class BagelImageOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    cfg_text_scale: float = Field(default=4.0, ge=0, le=50)
    cfg_img_scale: float = Field(default=1.0, ge=0, le=50)
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_min: float = Field(default=0.0, ge=0, le=1)
    timestep_shift: float = Field(default=3.0, gt=0, le=20)


class BagelChatImageOptions(BagelImageOptions):
    size: str = "1024x1024"
    num_inference_steps: int = Field(default=50, ge=2, le=200)


def is_bagel(pipeline: ResolvedPipeline) -> bool:
    return pipeline.pipeline == PIPELINE


def _validated(model: type[BagelImageOptions], extra: dict[str, Any] | None) -> Any:
    try:
        return model.model_validate(extra or {})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise BadRequest(f"{where}: {error['msg']}", param=where) from None


def bagel_image_params(extra: dict[str, Any] | None) -> dict[str, Any]:
    """The CFG and flow extensions of an image request, checked."""
    options = _validated(BagelImageOptions, extra)
    for side in options.cfg_interval:
        if not 0 <= side <= 1:
            raise BadRequest("cfg_interval: two numbers in [0, 1]", param="cfg_interval")
    return {
        "cfg_text_scale": options.cfg_text_scale,
        "cfg_img_scale": options.cfg_img_scale,
        "cfg_interval": list(options.cfg_interval),
        "cfg_renorm_min": options.cfg_renorm_min,
        "timestep_shift": options.timestep_shift,
    }


def bagel_chat_image_params(extra: dict[str, Any] | None, parse_size: Any) -> dict[str, Any]:
    """A chat request's image: its size and steps beside the CFG extensions."""
    options = _validated(BagelChatImageOptions, extra)
    width, height = parse_size(options.size)
    return {
        **bagel_image_params(extra),
        "width": width,
        "height": height,
        "num_inference_steps": options.num_inference_steps,
    }
