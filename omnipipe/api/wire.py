"""What the router and the workers say to each other over the workers' control API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

# A result's string fields longer than this travel as `part` events, so that every line
# of an event stream stays small whatever the result's size (a 2048x2048 PNG is ~16 MB
# of base64): the router reads and forwards a result piece by piece, never whole.
PART_CHARS: Final = 256 * 1024
# The longest event line a reader accepts. Parts are at most PART_CHARS characters, 6
# bytes each once JSON-escaped at worst; anything longer is a broken or hostile stage.
MAX_EVENT_BYTES: Final = 8 * 1024 * 1024


# A stage's `done` event may carry {"usage": {key: count}}: what it read and made of the
# request. The router adds up every stage's into the response's OpenAI-shaped `usage`.
TEXT_TOKENS: Final = "text_tokens"  # the prompt's tokens, as the text encoder read them
IMAGE_TOKENS: Final = "image_tokens"  # the input images' tokens, as the DiT attends to them
OUTPUT_TOKENS: Final = "output_tokens"  # the tokens of the images the DiT made
USAGE_KEYS: Final = (TEXT_TOKENS, IMAGE_TOKENS, OUTPUT_TOKENS)


def usage_counts(data: dict[str, Any]) -> dict[str, int]:
    """The usage a `done` event's data carries: the known keys' whole, non-negative
    counts; anything else is left out (a stage of another version may send more)."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return {}
    return {
        k: v
        for k, v in usage.items()
        if k in USAGE_KEYS and isinstance(v, int) and not isinstance(v, bool) and v >= 0
    }


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
    progress: bool = False
    """A stepped stage (a denoiser) sends a `progress` event after each of the
    request's steps: what a video job's percent is made of."""


class StageEvent(WireModel):
    """One line of a request's event stream (NDJSON).

    `result` completes result `index`. Before it, `part` events may carry that result's
    long string fields in order, `text` a piece of field `key`; the result's `data` then
    leaves those fields out. `progress` says, in `data`, how many of its `steps` the
    request has had (`step`). `error` and `done` end the stream; `done`'s data may hold
    the stage's `usage` (usage_counts)."""

    type: Literal["result", "part", "progress", "error", "done"]
    index: int = 0
    data: dict[str, Any] = {}
    key: str = ""
    text: str = ""
    message: str = ""
    code: str = ""
    param: str = ""
    """With an `invalid_request` error: the request field at fault, relayed as the
    OpenAI error's `param`."""


def event_lines(event: StageEvent, part_chars: int = PART_CHARS) -> Iterator[bytes]:
    """The NDJSON lines of one event, long string fields of a result split into parts."""
    if event.type != "result":
        yield event.model_dump_json().encode() + b"\n"
        return
    rest: dict[str, Any] = {}
    for key, value in event.data.items():
        if not isinstance(value, str) or len(value) <= part_chars:
            rest[key] = value
            continue
        for start in range(0, len(value), part_chars):
            part = StageEvent(
                type="part", index=event.index, key=key, text=value[start : start + part_chars]
            )
            yield part.model_dump_json().encode() + b"\n"
    yield event.model_copy(update={"data": rest}).model_dump_json().encode() + b"\n"


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
    revision: str = ""
    """The pipeline revision (omnipipe.api.revision) the worker runs: the router sends a
    request only through replicas of one revision."""


class StaticReplicas(WireModel):
    """The replicas file of local mode (`omnipipe router --replicas-file`), which
    `omnipipe serve` rewrites on a reload and the router re-reads when it changes."""

    stages: dict[str, list[str]]
    """Stage name -> control-API base URLs of its workers."""
    revision: str = ""
    """The newest revision: new requests start on it once every stage has a ready
    replica of it (empty: the router's own configuration decides)."""
    generation: int = 0
    """Bumped on every rewrite; the router reports the last one it applied in /ready, so
    `omnipipe serve` knows when the router has seen a change."""
    pipeline_file: str = ""
    """The resolved pipeline of `revision` (`omnipipe serve`'s per-revision snapshot):
    once new requests start on that revision, the router answers for the model it names
    (/v1/models, the model ids requests may give). Empty: the router's own file."""

    @classmethod
    def parse(cls, raw: str) -> StaticReplicas:
        """This model's JSON, or the older plain {stage: [urls]}."""
        data = json.loads(raw)
        if isinstance(data, dict) and isinstance(data.get("stages"), dict):
            return cls.model_validate(data)
        return cls(stages={str(k): [str(u) for u in v] for k, v in data.items()})
