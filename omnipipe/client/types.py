"""What the Python API (omnipipe.client) hands its callers: request outputs, whole
results and errors, and how the router's answers become them."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Literal

Modality = Literal["text", "audio", "image"]


class OmniError(RuntimeError):
    """The pipeline refused or failed a request, or is not running; `status`, `type`,
    `param` (the request field at fault) and `code` are the router's OpenAI-shaped
    error."""

    def __init__(
        self,
        message: str,
        status: int = 0,
        type: str = "",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type, code, param


class DuplicateRequestId(ValueError):
    """generate() was given a request_id that a request still running on the same
    AsyncOmni has: ids name requests (abort(request_id)), so one is never shared."""


@dataclass(frozen=True)
class OmniRequestOutput:
    """One stage's output for one request, as it is made. A stage's last item for a
    request has finished=True and carries no new payload."""

    request_id: str
    stage: str
    final_output_type: Modality | None
    text: str = ""  # a text delta
    audio: bytes = b""  # a chunk of 16-bit mono PCM at sample_rate
    sample_rate: int = 0
    image: bytes = b""  # a PNG
    index: int = 0  # which image, for n > 1
    finished: bool = False
    data: dict[str, Any] = field(default_factory=dict)  # every field the stage sent


@dataclass
class OmniResult:
    """A whole request's outputs, from Omni.generate()."""

    request_id: str
    text: str = ""
    audio_wav: bytes = b""
    images: list[bytes] = field(default_factory=list)
    outputs: list[OmniRequestOutput] = field(default_factory=list)


def error_from(error: dict[str, Any], status: int) -> OmniError:
    """The router's OpenAI error object (a response body's, or a stream's last line's)."""
    return OmniError(
        error["message"], status, error.get("type", ""), error.get("code"), error.get("param")
    )


def error_of(status: int, body: bytes) -> OmniError:
    try:
        return error_from(json.loads(body)["error"], status)
    except (ValueError, KeyError, TypeError):
        return OmniError(body[:500].decode(errors="replace") or f"HTTP {status}", status)


def output_of(
    request_id: str, stage: str, modality: Modality, index: int, data: dict[str, Any]
) -> OmniRequestOutput:
    if modality == "image":
        image = base64.b64decode(str(data["b64_json"]))
        return OmniRequestOutput(request_id, stage, modality, image=image, index=index, data=data)
    if modality == "audio":
        audio = base64.b64decode(str(data["audio"]))
        rate = int(data.get("sample_rate", 0))
        return OmniRequestOutput(
            request_id, stage, modality, audio=audio, sample_rate=rate, index=index, data=data
        )
    text = str(data.get("text", ""))
    return OmniRequestOutput(request_id, stage, modality, text=text, index=index, data=data)
