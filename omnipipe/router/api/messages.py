"""OpenAI chat messages as the thinker takes them: text, inline images, WAV clips and
one video, each part checked (omnipipe/router/api/inputs.py) and named by its place."""

from __future__ import annotations

from typing import Any

from omnipipe.api.plain_text import shown
from omnipipe.router.api.inputs import MAX_VIDEOS, audio_part, image_part, video_part
from omnipipe.router.errors import BadRequest

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


# Messages are converted by hand (thinker_messages); this describes them for clients and
# fuzzers reading the OpenAPI document.
_PART_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "image_url", "input_audio", "video_url"]},
        "text": {"type": "string"},
        "image_url": {
            "type": "object",
            "properties": {"url": {"type": "string", "description": "a data: URL, base64"}},
        },
        "video_url": {
            "type": "object",
            "properties": {
                "url": {"type": "string", "description": "a data: URL, base64 mp4 or webm"}
            },
        },
        "input_audio": {
            "type": "object",
            "properties": {"data": {"type": "string"}, "format": {"enum": ["wav"]}},
        },
    },
}
MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART_SCHEMA}]},
    },
}


def thinker_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> the thinker's: text, inline images and WAV clips, nothing else."""
    converted: list[dict[str, Any]] = []
    videos = 0
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = ROLES.get(str(message.get("role")))
        if role is None:
            raise BadRequest(
                f"{param}.role: expected one of {', '.join(ROLES)}, "
                f"got {shown(message.get('role'))}",
                param=param,
            )
        content = message.get("content")
        if isinstance(content, str):
            converted.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"{param}.content: expected a string or a list", param=param)
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            where = f"{param}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url":
                parts.append(image_part(part, where))
            elif kind == "input_audio":
                parts.append(audio_part(part, where))
            elif kind == "video_url":
                videos += 1
                if videos > MAX_VIDEOS:
                    raise BadRequest(
                        f"{where}: at most {MAX_VIDEOS} video per request", param=where
                    )
                parts.append(video_part(part, where))
            else:
                raise BadRequest(
                    f"{where}.type: unsupported content part {shown(kind)}", param=where
                )
        converted.append({"role": role, "content": parts})
    return converted
