"""What the router and the workers say to each other over the workers' control API."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Destination(WireModel):
    """A downstream replica that receives this stage's tensors."""

    stage: str
    address: str


class SubmitRequest(WireModel):
    """Sent to every chosen replica at once; downstream stages wait for their inputs."""

    request_id: str = Field(min_length=1, max_length=128)
    params: dict[str, Any]
    inputs: list[str] = []
    outputs: list[Destination] = []
    emit: bool = False
    timeout_seconds: float = Field(default=300.0, gt=0)


class StageEvent(WireModel):
    """One line of a request's event stream (NDJSON)."""

    type: Literal["result", "error", "done"]
    index: int = 0
    data: dict[str, Any] = {}
    message: str = ""
    code: str = ""


class WorkerStatus(WireModel):
    """A worker's readiness and load; the router picks the least-loaded ready replica."""

    pipeline: str
    stage: str
    ready: bool
    draining: bool
    running: int
    waiting: int
    transfer_address: str | None
    message: str = ""
