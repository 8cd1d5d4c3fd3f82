"""A finished video is kept in the store only up to OMNIPIPE_ROUTER_VIDEO_MAX_BYTES: a job
whose MP4 is bigger fails with both sizes named, and one within it completes with its
bytes. The stages are a fake worker's control API (tests/unit/test_router_results.py)
standing in for tiny Wan's three workers; the store is a real redis-server."""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from omnipipe.api import parse_resource, resolve
from omnipipe.local.video_store import start_redis
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
