"""diffusers-edit's request fields, on /v1/images/edits only: the pipeline's own defaults
for the steps, the guidance and `strength` where the client set none (Stable Diffusion
3's img2img and inpainting pipelines: 50 steps at 7.0, strength 0.6), and with no size
the input's own size (edit_size). Imported by the router,
so it stays light: no torch, no diffusers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from omnipipe.api.families import RequestProblem
from omnipipe.api.plain_text import PLAIN_DECIMAL, shown
from omnipipe.families.diffusers_any.requests import PIPELINE_DEFAULTED

# An edit with no size is made at its input's size, each side rounded down to 16 (what
# every diffusers image pipeline takes: an 8x VAE with 2x2 patches, or a 16x one) and at
# most the image API's largest side (router/api/images.py MAX_SIDE).
AUTO_MULTIPLE, MAX_AUTO_SIDE = 16, 2048
EDITS_ONLY = (
    "this pipeline edits an input image (with a mask, inpaints it): send the image to "
    "POST /v1/images/edits"
)


def checked_strength(value: object) -> float:
    """`strength`, as a form sends it (text) or a JSON body (a number): how far the edit
    may move from its input, above 0 (0 would leave no step to run) and at most 1 (the
    input repainted whole)."""
    problem = RequestProblem(
        f"strength must be a number above 0 and at most 1, got {shown(value)}", "strength"
    )
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise problem
    if isinstance(value, str) and not PLAIN_DECIMAL.fullmatch(value):
        raise problem
    try:
        strength = float(value)
    except OverflowError:
        raise problem from None
    if not (math.isfinite(strength) and 0 < strength <= 1):
        raise problem
    return strength


class DiffusersEditRequests:
    chat_makes_images = False
    # The extension fields edit_params reads: the router logs the others it is sent.
    edit_fields = frozenset({"strength"})

    def image_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        raise RequestProblem(EDITS_ONLY)

    def chat_image_params(
        self, request: Mapping[str, Any], parse_size: Callable[[str], tuple[int, int]]
    ) -> dict[str, Any]:
        raise RequestProblem(EDITS_ONLY)

    def edit_size(self, width: int, height: int) -> tuple[int, int]:
        """The size of an edit with no size (size=auto) of an input of width x height: its
        own, at most MAX_AUTO_SIDE a side at its aspect ratio, each side rounded down to
        AUTO_MULTIPLE."""
        scale = min(1.0, MAX_AUTO_SIDE / max(width, height))
        if min(width, height) * scale < AUTO_MULTIPLE:
            raise RequestProblem(
                f"image: {width}x{height} is too small or too narrow to edit: with no size, "
                f"an edit is made at its input's size, at least {AUTO_MULTIPLE} pixels a side",
                "image",
            )
        made_w, made_h = (
            int(side * scale) // AUTO_MULTIPLE * AUTO_MULTIPLE for side in (width, height)
        )
        return made_w, made_h

    def edit_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """What the client left unset as None, which the stage leaves to the pipeline
        (steps, guidance, strength)."""
        params: dict[str, Any] = {k: None for k in PIPELINE_DEFAULTED if request.get(k) is None}
        strength = request.get("strength")
        params["strength"] = None if strength in (None, "") else checked_strength(strength)
        return params


EXTENSIONS = DiffusersEditRequests()
