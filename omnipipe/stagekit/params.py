"""A request's stage parameters, read as a stage needs them: the router checked what the
client sent, so a wrong type here is another stage's or a caller's mistake, refused as
the client's error with the parameter named."""

from __future__ import annotations

from typing import Any

from omnipipe.stagekit.stage import StageInputError


def int_param(params: dict[str, Any], key: str, default: int) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise StageInputError(f"{key} must be an integer", key)
    return value


def float_param(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise StageInputError(f"{key} must be a number", key)
    return float(value)


def prompt_of(params: dict[str, Any]) -> str:
    prompt = params.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise StageInputError("prompt must be a non-empty string")
    return prompt
