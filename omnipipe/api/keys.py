"""Secrets read from the environment (API keys, the pipeline's credential): unset means
none, and set means a real key. An empty or blank value is refused at start: a Secret
whose key is empty would otherwise turn `Authorization: Bearer ` (no token) into the key
that opens every guarded route."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


def _not_blank(value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise ValueError("is set but empty: unset it to run without one, or give a real key")
    if value is not None and value != value.strip():
        raise ValueError("has leading or trailing whitespace, which no client would send")
    return value


SecretKey = Annotated[str | None, AfterValidator(_not_blank)]
