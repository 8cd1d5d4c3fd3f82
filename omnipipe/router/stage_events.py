"""Reading a stage's event stream (NDJSON, see api/wire.py): lines of bounded length
whatever a result's size, and the results put back together from their parts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from omnipipe.api.wire import MAX_EVENT_BYTES, StageEvent


class StreamBroken(Exception):
    """The stage sent something that is not an event stream."""


class ByteSource(Protocol):
    async def readany(self) -> bytes: ...


async def event_stream(
    source: ByteSource, max_line: int = MAX_EVENT_BYTES
) -> AsyncIterator[StageEvent]:
    """Events as they arrive. Lines are split here, not by the HTTP client, whose line
    limit (and the exception it raises past it) would decide what size a result may be."""
    buffer = bytearray()
    searched = 0
    parts_of: int | None = None  # the result whose parts are arriving
    while True:
        newline = buffer.find(b"\n", searched)
        if newline < 0:
            if len(buffer) > max_line:
                raise StreamBroken(f"an event line longer than {max_line} bytes")
            searched = len(buffer)
            chunk = await source.readany()
            if not chunk:
                if buffer.strip():
                    raise StreamBroken("the stream ended inside an event")
                return
            buffer += chunk
            continue
        line = bytes(buffer[:newline])
        del buffer[: newline + 1]
        searched = 0
        if len(line) > max_line:
            raise StreamBroken(f"an event line longer than {max_line} bytes")
        if not line.strip():
            continue
        try:
            event = StageEvent.model_validate_json(line)
        except ValidationError as exc:
            raise StreamBroken(f"a malformed event: {exc.errors()[0]['msg']}") from None
        # A result's parts come together, right before it: readers forward them as such.
        if event.type == "part" and not event.key:
            raise StreamBroken("a part event without a key")
        continues = event.type in ("part", "result") and event.index == parts_of
        if parts_of is not None and event.type != "error" and not continues:
            raise StreamBroken(f"result {parts_of} interrupted before it was complete")
        parts_of = event.index if event.type == "part" else None
        yield event


@dataclass
class PartAssembler:
    """Collects a result's parts; the result event completes it. Pieces are joined once,
    when the whole result is wanted."""

    pieces: dict[tuple[int, str], list[str]] = field(default_factory=dict)

    def add(self, event: StageEvent) -> None:
        self.pieces.setdefault((event.index, event.key), []).append(event.text)

    def complete(self, event: StageEvent) -> dict[str, Any]:
        """The whole data of result event.index."""
        data = dict(event.data)
        for key in [k for k in self.pieces if k[0] == event.index]:
            data[key[1]] = "".join(self.pieces.pop(key))
        return data
