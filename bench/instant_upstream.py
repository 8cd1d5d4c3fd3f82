"""A fake upstream that answers at once: a measuring instrument, not an engine.

It speaks both protocols a router in front of it needs: OpenAI's
`POST /v1/chat/completions` (for direct calls and vllm-router) and the omnipipe worker's
control API (`GET /ready`, `POST /v1/requests` with its NDJSON event stream), so every
router under test reaches the same zero-cost backend.

    .venv/bin/python bench/instant_upstream.py PORT
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

COMPLETION = json.dumps(
    {
        "id": "chatcmpl-instant",
        "object": "chat.completion",
        "created": 0,
        "model": "instant",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
READY = json.dumps(
    {
        "pipeline": "instant",
        "stage": "llm",
        "ready": True,
        "draining": False,
        "running": 0,
        "waiting": 0,
        "transfer_address": "tcp://127.0.0.1:1",
        "message": "ready",
    }
).encode()
EVENTS = (
    json.dumps({"type": "result", "index": 0, "data": {"text": "ok"}}).encode()
    + b"\n"
    + json.dumps(
        {
            "type": "result",
            "index": 1,
            "data": {"finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1},
        }
    ).encode()
    + b"\n"
    + json.dumps({"type": "done"}).encode()
    + b"\n"
)
MODELS = json.dumps({"object": "list", "data": [{"id": "instant", "object": "model"}]}).encode()


async def _reply(send: Send, body: bytes, content_type: str = "application/json") -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", content_type.encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:  # drain the request body
        more = (await receive()).get("more_body", False)
    path = scope["path"]
    if path == "/v1/chat/completions":
        await _reply(send, COMPLETION)
    elif path == "/v1/requests":
        await _reply(send, EVENTS, "application/x-ndjson")
    elif path == "/ready":
        await _reply(send, READY)
    elif path == "/v1/models":
        await _reply(send, MODELS)
    else:  # /health, cancel, anything else
        await _reply(send, b"{}")


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
