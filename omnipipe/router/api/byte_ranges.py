"""A stored body answered as HTTP's byte ranges (RFC 9110, section 14): a video player
seeks with `Range: bytes=...`, and a download resumes with it. One range is answered 206
with Content-Range; a range past the end 416 with the body's length; several ranges, or
a header this does not read, the whole body (which RFC 9110 allows a server to send), as
does an If-Range that names another validator than the body's."""

from __future__ import annotations

import re

from fastapi import Request, Response

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


def ranged(body: bytes, media_type: str, request: Request, etag: str) -> Response:
    """The body (or a part of it) as the request's Range asks; headers only for HEAD,
    which ignores Range (RFC 9110 defines ranges for GET alone). `etag`: the body's
    strong validator (it never changes), for a client resuming with If-Range."""
    length = len(body)
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
    status = 200
    if isinstance(span, tuple):
        first, last = span
        body = body[first : last + 1]
        headers["Content-Range"] = f"bytes {first}-{last}/{length}"
        status = 206
    if head:
        headers["Content-Length"] = str(len(body))
        return Response(b"", status_code=status, headers=headers, media_type=media_type)
    return Response(body, status_code=status, headers=headers, media_type=media_type)
