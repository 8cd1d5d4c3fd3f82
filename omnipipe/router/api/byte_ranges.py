"""A stored body answered as HTTP's byte ranges (RFC 9110, section 14): a video player
seeks with `Range: bytes=...`, and a download resumes with it. One range is answered 206
with Content-Range; a range past the end 416 with the body's length; several ranges, or
a header this does not read, the whole body (which RFC 9110 allows a server to send), as
does an If-Range that names another validator than the body's."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

# bytes=FIRST-[LAST] or bytes=-SUFFIX, one range, ASCII digits (the unit's case is free).
ONE_RANGE = re.compile(r"bytes=(?:([0-9]{1,18})-([0-9]{0,18})|-([0-9]{1,18}))", re.IGNORECASE)


def _span(header: str, length: int) -> tuple[int, int] | bool | None:
    """(first, last) of one satisfiable range; None: answer the whole body; False: none
    of it can be satisfied."""
    m = ONE_RANGE.fullmatch(header.strip())
    if m is None:
        return None
    if m[3] is not None:
        suffix = int(m[3])
        if suffix == 0 or length == 0:
            return False
        return max(0, length - suffix), length - 1
    first = int(m[1])
    if m[2] and int(m[2]) < first:
        return None  # syntactically invalid: ignored, as RFC 9110 says
    if first >= length:
        return False
    last = int(m[2]) if m[2] else length - 1
    return first, min(last, length - 1)


# What a download reads from the store at a time: a client that reads slowly holds this,
# not the video (a few of them ride in the socket's buffers while it is slow).
PART_BYTES = 1 << 20


class BodyGone(Exception):
    """The stored body went away before its first part was read."""


async def ranged(
    length: int,
    read: Callable[[int, int], Awaitable[bytes]],
    media_type: str,
    request: Request,
    etag: str,
) -> Response:
    """The body (or a part of it) as the request's Range asks, streamed a part at a time
    as the client takes it; headers only for HEAD, which ignores Range (RFC 9110 defines
    ranges for GET alone). `read(first, last)`: the body's bytes first..last. The first
    part is read before the status line, so a store that fails or a body gone by then is
    the caller's error (read's exception, or BodyGone); later, a body that went away
    ends the response short of its Content-Length, which a client sees as a broken
    download. `etag`: the body's strong validator (it never changes), for a client
    resuming with If-Range."""
    validator = f'"{etag}"'
    headers = {"Accept-Ranges": "bytes", "ETag": validator}
    head = request.method == "HEAD"
    range_header = request.headers.get("range")
    if_range = request.headers.get("if-range")
    ranges = range_header is not None and not head and if_range in (None, validator)
    span = _span(range_header, length) if ranges and range_header is not None else None
    if span is False:
        headers["Content-Range"] = f"bytes */{length}"
        return Response(b"", status_code=416, headers=headers)
    status, first, last = 200, 0, length - 1
    if isinstance(span, tuple):
        first, last = span
        headers["Content-Range"] = f"bytes {first}-{last}/{length}"
        status = 206
    headers["Content-Length"] = str(last - first + 1)
    if head:
        return Response(b"", status_code=status, headers=headers, media_type=media_type)
    spans = [(s, min(s + PART_BYTES, last + 1) - 1) for s in range(first, last + 1, PART_BYTES)]
    opening = await read(*spans[0])
    if not opening:
        raise BodyGone

    async def parts() -> AsyncIterator[bytes]:
        part = opening
        for start, end in spans:
            if start != first:
                part = await read(start, end)
            if part:
                yield part
            if len(part) < end - start + 1:
                return

    return StreamingResponse(parts(), status_code=status, headers=headers, media_type=media_type)
