"""A finished video's bytes in the router: a job whose MP4 is over
OMNIPIPE_ROUTER_VIDEO_MAX_BYTES fails with both sizes named and one within it completes
with its bytes; the content answers byte ranges and HEAD; slow downloads hold a part each,
not the video. The stages are a fake worker's control API (tests/unit/test_router_results.py)
standing in for tiny Wan's three workers; the store is a real redis-server."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from omnipipe.api import parse_resource, resolve
from omnipipe.local.video_store import start_redis
from omnipipe.router.api.byte_ranges import PART_BYTES
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings
from tests.unit import test_router_results
from tests.unit.test_router_results import FakeWorker, results

pytestmark = pytest.mark.timeout(60)
# The fake worker's fixture, used here too.
serve_worker = test_router_results.serve_worker

WAN = resolve(
    parse_resource(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": "v"},
            "spec": {"model": "tiny://wan", "pipeline": "wan"},
        }
    )
)
SMALL = {"prompt": "x", "size": "64x48", "num_frames": 9, "num_inference_steps": 2}
LIMIT = 4096


def finished(client: TestClient, video_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        job: dict[str, Any] = client.get(f"/v1/videos/{video_id}").json()
        if job["status"] in ("completed", "failed"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


@pytest.mark.parametrize("size", [LIMIT, LIMIT + 1])
def test_a_video_past_the_byte_limit_fails_naming_both_sizes(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str], size: int
) -> None:
    mp4 = os.urandom(size)
    url = serve_worker(FakeWorker(results({"b64_mp4": base64.b64encode(mp4).decode()})))
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: [url] for s in WAN.stages}))
    server, store = start_redis(tmp_path / "redis")
    settings = RouterSettings(replicas_file=str(replicas), video_store=store, video_max_bytes=LIMIT)
    try:
        with TestClient(build_app(WAN, settings)) as client:
            video_id = client.post("/v1/videos", json=SMALL).json()["id"]
            job = finished(client, video_id)
            content = client.get(f"/v1/videos/{video_id}/content")
    finally:
        server.terminate()
        server.wait(10)
    if size <= LIMIT:
        assert job["status"] == "completed", job
        assert content.content == mp4
        return
    assert job["status"] == "failed", job
    assert job["error"]["code"] == "video_too_large"
    assert job["error"]["message"].startswith(
        f"the video is {size:,} bytes, past the {LIMIT:,} a job may keep"
    )
    assert content.status_code == 409, content.text


def test_the_content_answers_byte_ranges_and_head(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """A video player seeks with Range and a download resumes with it: one range is a
    206 with its bytes, one past the end a 416 naming the length, anything else the
    whole MP4; If-Range is checked against the video's ETag; HEAD says the length and
    sends no body."""
    mp4 = os.urandom(1000)
    url = serve_worker(FakeWorker(results({"b64_mp4": base64.b64encode(mp4).decode()})))
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: [url] for s in WAN.stages}))
    server, store = start_redis(tmp_path / "redis")
    try:
        with TestClient(
            build_app(WAN, RouterSettings(replicas_file=str(replicas), video_store=store))
        ) as client:
            video_id = client.post("/v1/videos", json=SMALL).json()["id"]
            assert finished(client, video_id)["status"] == "completed"
            path = f"/v1/videos/{video_id}/content"

            def get(range_header: str | bytes | None, method: str = "GET", **more: str) -> Any:
                headers = {} if range_header is None else {"Range": range_header}
                return client.request(method, path, headers={**headers, **more})

            whole = get(None)
            assert (whole.status_code, whole.content) == (200, mp4)
            assert whole.headers["accept-ranges"] == "bytes"
            assert whole.headers["etag"] == f'"{video_id}"'
            for header, first, last in (
                ("bytes=0-99", 0, 99),
                ("bytes=900-", 900, 999),
                ("bytes=-10", 990, 999),
                ("bytes=990-5000", 990, 999),
                ("BYTES=0-0", 0, 0),
            ):
                part = get(header)
                assert part.status_code == 206, header
                assert part.content == mp4[first : last + 1], header
                assert part.headers["content-range"] == f"bytes {first}-{last}/1000"
            past = get("bytes=1000-")
            assert past.status_code == 416
            assert past.headers["content-range"] == "bytes */1000"
            # A resume that names this video's validator gets its range; another, all.
            resumed = get("bytes=10-19", **{"If-Range": f'"{video_id}"'})
            assert (resumed.status_code, resumed.content) == (206, mp4[10:20])
            stale = get("bytes=10-19", **{"If-Range": '"another"'})
            assert (stale.status_code, stale.content) == (200, mp4)
            for ignored in ("bytes=5-2", "bytes=0-1,5-6", "items=0-1", "bytes=\u0661-2".encode()):
                assert (get(ignored).status_code, get(ignored).content) == (200, mp4), ignored
            head = get(None, "HEAD")
            assert (head.status_code, head.content) == (200, b"")
            assert head.headers["content-length"] == "1000"
            # RFC 9110 defines ranges for GET alone: HEAD ignores one.
            ranged_head = get("bytes=0-9", "HEAD")
            assert ranged_head.status_code == 200
            assert ranged_head.headers["content-length"] == "1000"
    finally:
        server.terminate()
        server.wait(10)


def test_slow_downloads_hold_a_part_each_not_the_video(
    tmp_path: Path, serve_worker: Callable[[FakeWorker], str]
) -> None:
    """Four clients that stop reading after the first bytes of a 16 MiB video: the router
    holds under two parts (a part is 1 MiB) for each while they wait, where whole videos
    would be 64 MiB. Once they read on, each gets the whole MP4."""
    mp4 = os.urandom(16 << 20)
    url = serve_worker(FakeWorker(results({"b64_mp4": base64.b64encode(mp4).decode()})))
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({s.name: [url] for s in WAN.stages}))
    server, store = start_redis(tmp_path / "redis")
    settings = RouterSettings(replicas_file=str(replicas), video_store=store)
    app = build_app(WAN, settings)
    try:
        with TestClient(app) as client:
            video_id = client.post("/v1/videos", json=SMALL).json()["id"]
            assert finished(client, video_id)["status"] == "completed"
            expected = hashlib.sha256(mp4).hexdigest()
            del mp4  # the test keeps no copy of its own in what is measured
            tracemalloc.start()
            try:
                held, digests = client.portal.call(slow_downloads, app, video_id, 4)
            finally:
                tracemalloc.stop()
    finally:
        server.terminate()
        server.wait(10)
    assert held < 4 * 2 * PART_BYTES, held
    assert digests == [expected] * 4


async def slow_downloads(app: Any, video_id: str, clients: int) -> tuple[int, list[str]]:
    """`clients` downloads as raw ASGI calls that stall after their first body message;
    what the process holds then (tracemalloc's current bytes), and each body's digest."""
    go_on = asyncio.Event()
    stalled = asyncio.Semaphore(0)

    async def download() -> str:
        digest = hashlib.sha256()
        first = True
        hung_up = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": b"", "more_body": False}
            await hung_up.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] != "http.response.body":
                assert message["status"] == 200, message
                return
            digest.update(message.get("body", b""))
            if not go_on.is_set():
                stalled.release()
                await go_on.wait()

        path = f"/v1/videos/{video_id}/content"
        await app(request_scope(path), receive, send)
        return digest.hexdigest()

    tasks = [asyncio.create_task(download()) for _ in range(clients)]
    for _ in range(clients):
        await asyncio.wait_for(stalled.acquire(), 30)
    held, _ = tracemalloc.get_traced_memory()
    go_on.set()
    return held, list(await asyncio.wait_for(asyncio.gather(*tasks), 60))


def request_scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5000),
        "root_path": "",
    }
