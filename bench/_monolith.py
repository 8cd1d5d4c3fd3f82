"""The monolithic reference: one process, one engine thread, the three stages' work run
one after another per request, as a single-server deployment does.

    .venv/bin/python bench/_monolith.py PORT SECONDS_PER_STAGE STAGES
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn

ENGINE = ThreadPoolExecutor(max_workers=1)
SECONDS, STAGES = float(sys.argv[2]), int(sys.argv[3])
BODY = b'{"created": 0, "data": [{"b64_json": ""}]}'


def run_all_stages() -> None:
    for _ in range(STAGES):
        time.sleep(SECONDS)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    if scope["path"] == "/v1/images/generations":
        await asyncio.get_running_loop().run_in_executor(ENGINE, run_all_stages)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": BODY})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
