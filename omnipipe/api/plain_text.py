"""What a client may read of a message that quotes Python objects: no object reprs
(`<PIL.Image.Image ... at 0x7f...>`), no numpy arrays or torch tensors printed in full
(`array([0.1, ...], dtype=float32)`), and short. Shared by the workers, which word
refusals, and the router, which relays them. Also what a client's text must look like to
be read as a number."""

from __future__ import annotations

import re

# A number as a form sends it: ASCII decimal, nothing around it. float() and pydantic
# also read spaces, underscores and other scripts' digits ("1_0", " 3 ", "٣").
PLAIN_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,3})?")
SHOWN_CHARS = 64
_OBJECT_REPR = re.compile(r"<[^<>\n]*? at 0x[0-9a-fA-F]+>")
_ARRAY_START = re.compile(r"\b(?:array|tensor)\(")


def _without_arrays(message: str) -> str:
    parts, i = [], 0
    while (found := _ARRAY_START.search(message, i)) is not None:
        depth, end = 0, found.end() - 1
        for end in range(found.end() - 1, len(message)):
            depth += {"(": 1, ")": -1}.get(message[end], 0)
            if depth == 0:
                break
        parts.append(message[i : found.start()] + "an array")
        i = end + 1
    return "".join(parts) + message[i:]


def plain_message(message: str, limit: int) -> str:
    message = _without_arrays(_OBJECT_REPR.sub("an object", message))
    return message if len(message) <= limit else message[: limit - 3] + "..."


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """A client's value as a message quotes it: its repr, cut to `limit` characters (a
    1 MB model name is not echoed back whole)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
