"""Results of any size reach the client. Through `omnipipe serve` and the tiny model:
OpenAI's default image size, and the largest request the API allows (2048x2048, n=4).
A stand-in decode stage sends the worst case of that response, four 2048x2048 PNGs of
noise (4 x 16 MiB of base64), through a real router process, whose memory stays well
below the size of what it forwards."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from PIL import Image

from omnipipe.api.constants import CREDENTIAL_ENV, CREDENTIAL_HEADER
from omnipipe.api.wire import StageEvent, SubmitRequest, event_lines
from omnipipe.local.ports import free_port
from tests.e2e.conftest import REPO, Served, start_serve, stop_cleanly, write_pipeline

pytestmark = pytest.mark.timeout(600)
CREDENTIAL = "large-results-credential"
IMAGE_B64 = 16 * 2**20  # a 2048x2048 PNG of noise is about 12 MiB, 16 MiB as base64
FAST = {"num_inference_steps": 1, "seed": 3}


@pytest.fixture(scope="module")
def served(tmp_module: Path) -> Iterator[Served]:
    s = start_serve(write_pipeline(tmp_module, "large"))
    yield s
    stop_cleanly(s)


def client(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=540)


def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def decode(b64: str | None) -> Image.Image:
    assert b64
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_default_size_image_arrives(served: Served) -> None:
    with client(served) as c:
        r = c.images.generate(model="large", prompt="a fox", size="1024x1024", extra_body=FAST)
    [item] = r.data
    assert decode(item.b64_json).size == (1024, 1024)


def test_largest_request_four_2048_images_arrive(served: Served) -> None:
    """The tiny model's own 2048x2048 x4, over the default (UCX) transfer: four distinct
    full-size PNGs. The decode stage decodes them one by one (bounded memory), and the
    router streams each as parts."""
    started = time.monotonic()
    with client(served) as c:
        r = c.images.generate(model="large", prompt="a fox", size="2048x2048", n=4, extra_body=FAST)
    elapsed = time.monotonic() - started
    images = [decode(item.b64_json) for item in r.data]
    assert [i.size for i in images] == [(2048, 2048)] * 4
    # One seed per image (seed + i): four different images, not one sent four times.
    assert len({i.tobytes() for i in images}) == 4
    print(f"\n2048x2048 x4 from the tiny model in {elapsed:.1f}s")


def stand_in_stages(images: list[str]) -> FastAPI:
    """Every stage of the pipeline in one app: ready, and the decode stage answers with
    `images`; calls without the pipeline credential are refused."""
    app = FastAPI()

    @app.get("/ready")
    async def ready() -> dict[str, object]:
        return {
            "pipeline": "large",
            "stage": "any",
            "ready": True,
            "draining": False,
            "running": 0,
            "waiting": 0,
            "transfer_address": "tcp://127.0.0.1:1",
        }

    @app.post("/v1/requests")
    async def submit(request: Request) -> StreamingResponse:
        assert request.headers.get(CREDENTIAL_HEADER) == CREDENTIAL
        body = SubmitRequest.model_validate_json(await request.body())

        async def events() -> AsyncIterator[bytes]:
            for i, image in enumerate(images if body.emit else []):
                for line in event_lines(
                    StageEvent(type="result", index=i, data={"b64_json": image})
                ):
                    yield line
            yield StageEvent(type="done").model_dump_json().encode() + b"\n"

        return StreamingResponse(events(), media_type="application/x-ndjson")

    return app


@pytest.fixture
def stand_in_router(tmp_path: Path) -> Iterator[tuple[str, int, list[str]]]:
    images = [base64.b64encode(os.urandom(IMAGE_B64 * 3 // 4)).decode() for _ in range(4)]
    stages_port, router_port = free_port(), free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            stand_in_stages(images), host="127.0.0.1", port=stages_port, log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{stages_port}"
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s: [url] for s in ("encode", "denoise", "decode")}))
    manifest = write_pipeline(tmp_path, "large")
    router = subprocess.Popen(
        [
            *(sys.executable, "-m", "omnipipe.cli", "router", "--pipeline", str(manifest)),
            *("--host", "127.0.0.1", "--port", str(router_port)),
            *("--replicas-file", str(replicas)),
        ],
        cwd=REPO,
        env={**os.environ, CREDENTIAL_ENV: CREDENTIAL},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, "the router exited"
            assert time.monotonic() < deadline, "the router did not become ready"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{router_port}/ready", timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{router_port}/v1", router.pid, images
    finally:
        router.terminate()
        router.wait(timeout=30)
        server.should_exit = True
        thread.join(timeout=10)


def test_four_2048_sized_images_pass_with_bounded_router_memory(
    stand_in_router: tuple[str, int, list[str]],
) -> None:
    base_url, router, images = stand_in_router
    before = memory_kib(router, "VmRSS")
    started = time.monotonic()
    # Streamed to the client as well: the client is not what is measured here.
    with httpx.stream(
        "POST",
        f"{base_url}/images/generations",
        json={"model": "large", "prompt": "a fox", "size": "2048x2048", "n": 4},
        timeout=120,
    ) as resp:
        assert resp.status_code == 200
        body = resp.read()
    elapsed = time.monotonic() - started
    data = json.loads(body)["data"]
    assert [d["b64_json"] for d in data] == images
    peak = memory_kib(router, "VmHWM")
    forwarded = sum(len(i) for i in images)
    print(
        f"\n4 x {IMAGE_B64 / 2**20:.0f} MiB of base64 through the router in {elapsed:.2f}s; "
        f"router RSS {before / 1024:.0f} MiB before, peak {peak / 1024:.0f} MiB"
    )
    # The router forwards the images piece by piece: its peak grows by far less than
    # what passed through it (it held every image whole, and copies of them, before).
    assert (peak - before) * 1024 < forwarded / 4, (peak, before, forwarded)
