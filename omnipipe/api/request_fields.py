"""A request's numeric fields as the families' request extensions check them: a number
sent as JSON or as a form's plain decimal string, within bounds, or a 400 that names the
field (RequestProblem). Light: the router imports the extensions that use it."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from omnipipe.api.families import RequestProblem
from omnipipe.api.plain_text import PLAIN_DECIMAL, shown

# ASCII digits only: \d alone takes any script's (fullwidth, Arabic-Indic), and int()
# reads them.
SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")


def given(request: Mapping[str, Any], key: str) -> bool:
    """Whether the client set `key` (an empty form field is not setting it)."""
    return request.get(key) not in (None, "")


def number_field(request: Mapping[str, Any], key: str, low: float, high: float) -> float:
    """The field's number, from `low` to `high`."""
    value: Any = request.get(key)
    if isinstance(value, bool) or (isinstance(value, str) and not PLAIN_DECIMAL.fullmatch(value)):
        raise RequestProblem(f"{key} must be a number, got {shown(value)}", key)
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise RequestProblem(f"{key} must be a number, got {shown(value)}", key) from None
    if not math.isfinite(number) or not low <= number <= high:
        raise RequestProblem(f"{key} must be between {low:g} and {high:g}, got {shown(value)}", key)
    return number


def integer_field(request: Mapping[str, Any], key: str, low: int, high: int) -> int:
    """The field's whole number, from `low` to `high`."""
    number = number_field(request, key, low, high)
    if number != int(number):
        raise RequestProblem(f"{key} must be an integer, got {shown(request.get(key))}", key)
    return int(number)


def size_field(
    request: Mapping[str, Any], default: str, multiple: int, low: int, high: int
) -> tuple[int, int]:
    """(width, height) of the request's "WxH" `size` (`default` where unset), each side
    a multiple of `multiple` from `low` to `high`."""
    size = request.get("size") or default
    m = SIZE.fullmatch(str(size))
    if not m:
        raise RequestProblem(f"size must look like {default}, got {shown(size)}", "size")
    width, height = int(m[1]), int(m[2])
    for side in (width, height):
        if not low <= side <= high or side % multiple:
            raise RequestProblem(
                f"size sides must be multiples of {multiple} from {low} to {high}, "
                f"got {shown(size)}",
                "size",
            )
    return width, height


def text_field(request: Mapping[str, Any], key: str, most: int) -> str:
    """The field's text, at most `most` characters; "" where unset."""
    value = request.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RequestProblem(f"{key} must be a string", key)
    if len(value) > most:
        raise RequestProblem(f"{key}: at most {most} characters, got {len(value)}", key)
    return value


class TextToVideoRequests:
    """What a text-to-video type's request extensions share: /v1/videos alone, and the
    extension fields its video_params reads (the router logs the others it is sent)."""

    chat_makes_images = False
    video_fields = frozenset(
        {"num_frames", "fps", "negative_prompt", "num_inference_steps", "guidance_scale"}
    )

    def image_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        raise RequestProblem("this pipeline makes videos: send the prompt to POST /v1/videos")

    def chat_image_params(
        self, request: Mapping[str, Any], parse_size: Callable[[str], tuple[int, int]]
    ) -> dict[str, Any]:
        raise RequestProblem("this pipeline makes videos: send the prompt to POST /v1/videos")
