"""The bounds a stage's loaded model puts on a request's parameters (a DiT's rotary
positions bound a video's side and length, say). A stage publishes them once loaded
(GET /control/limits); the router checks a request against them before it takes the
request, and the stage checks them again when the request reaches it, with the same
words: a client hears the model's limit at once, not minutes later from inside a job."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import Field

from omnipipe.api.wire import WireModel


class ParamLimit(WireModel):
    """At most `maximum` for the stage parameter `param`, which the client sets through
    the request field `field`; `why` says whose limit it is, for the refusal."""

    param: str = Field(min_length=1, max_length=64)
    maximum: int
    field: str = Field(min_length=1, max_length=64)
    why: str = Field(min_length=1, max_length=200)

    def refusal(self, value: object) -> str:
        return f"{self.param} {value}: {self.why}"


class StageLimits(WireModel):
    """GET /control/limits: the stage's limits (none for most stages)."""

    stage: str
    limits: tuple[ParamLimit, ...] = ()


def exceeded(params: Mapping[str, Any], limits: Iterable[ParamLimit]) -> ParamLimit | None:
    """The first limit that a number in `params` goes past; a parameter that is absent or
    not a number is not this check's business."""
    for limit in limits:
        value = params.get(limit.param)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if value > limit.maximum:
            return limit
    return None
