"""The video API over a real redis-server: a store that stops answering is a 503 in
OpenAI's shape with Retry-After (never a 500 or a hang), and the job is there again once
the store is back; a job queued while no replica runs jobs stays queued."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from omnipipe.api import parse_resource, resolve
from omnipipe.local.ports import free_port
from omnipipe.local.video_store import start_redis
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings

pytestmark = pytest.mark.timeout(60)
# The resource's TTL is what the router keeps things for.
PIPELINE = resolve(
    parse_resource(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": "v"},
            "spec": {"model": "tiny://wan", "pipeline": "wan", "videos": {"ttlSeconds": 120}},
        }
    )
)
SMALL = {"prompt": "x", "size": "64x48", "num_frames": 9, "num_inference_steps": 2}


@pytest.fixture
def api(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[TestClient, Path, int]]:
    """The router (no stage replicas; as many job takers as the test's parameter says,
    none by default) on a redis-server of its own."""
    takers = getattr(request, "param", 0)
    port = free_port()
    server, url = start_redis(tmp_path / "redis", port)
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({"stages": {s.name: [] for s in PIPELINE.stages}}))
    settings = RouterSettings(
        replicas_file=str(replicas),
        video_store=url,
        video_jobs_per_replica=takers,
        wake_wait_seconds=0.2,
    )
    try:
        with TestClient(build_app(PIPELINE, settings)) as client:
            yield client, tmp_path, port
    finally:
        server.terminate()
        server.wait(10)


def test_a_store_that_stops_answering_is_a_503_and_the_job_outlives_it(
    api: tuple[TestClient, Path, int],
) -> None:
    client, tmp_path, port = api
    made = client.post("/v1/videos", json=SMALL)
    assert made.status_code == 200, made.text
    video_id = made.json()["id"]
    assert client.get(f"/v1/videos/{video_id}").json()["status"] == "queued"
    # The store goes away: the job is saved to disk first, so a store that comes back
    # with its data (as a Redis with persistence does) has it.
    store = redis.Redis(port=port)
    store.save()
    store.shutdown(nosave=True)
    for call in (
        lambda: client.get(f"/v1/videos/{video_id}"),
        lambda: client.get("/v1/videos"),
        lambda: client.post("/v1/videos", json=SMALL),
        lambda: client.delete(f"/v1/videos/{video_id}"),
        lambda: client.get(f"/v1/videos/{video_id}/content"),
    ):
        down = call()
        assert down.status_code == 503, down.text
        assert down.headers["retry-after"] == "5"
        assert down.json()["error"] == {
            "message": "the video job store is unavailable; retry later",
            "type": "service_unavailable",
            "param": None,
            "code": None,
        }
    back, _ = start_redis(tmp_path / "redis", port)
    try:
        job = client.get(f"/v1/videos/{video_id}")
        assert job.status_code == 200, job.text
        assert job.json()["status"] == "queued"
    finally:
        back.terminate()
        back.wait(10)


def test_a_deleted_job_is_gone_at_once_and_its_flag_lives_the_resources_ttl(
    api: tuple[TestClient, Path, int],
) -> None:
    client, _, port = api
    video_id = client.post("/v1/videos", json=SMALL).json()["id"]
    assert client.delete(f"/v1/videos/{video_id}").json() == {
        "id": video_id,
        "object": "video.deleted",
        "deleted": True,
    }
    assert client.get(f"/v1/videos/{video_id}").status_code == 404
    assert client.get("/v1/videos").json()["data"] == []
    store = redis.Redis(port=port)
    # What tells a replica that might be running it to stop, kept as long as any job.
    assert 110 < store.ttl(f"omnipipe:videos:v:cancel:{video_id}") <= 120
    assert store.llen("omnipipe:videos:v:queue") == 0


@pytest.mark.parametrize("api", [1], indirect=True)
def test_a_job_no_stage_can_take_waits_in_the_queue_and_does_not_fail(
    api: tuple[TestClient, Path, int], caplog: pytest.LogCaptureFixture
) -> None:
    """Every stage at zero replicas (a cluster waking its GPUs): the job is taken, finds
    no replica, and goes back to the queue, again and again, never failing meanwhile."""
    client, _, _ = api
    caplog.set_level(logging.INFO, logger="omnipipe.router.videos.runner")
    video_id = client.post("/v1/videos", json=SMALL).json()["id"]
    deadline = time.monotonic() + 30
    while "waits again" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.1)
    job = client.get(f"/v1/videos/{video_id}").json()
    assert job["status"] in ("queued", "in_progress"), job
    assert job["error"] is None
    assert f"video job {video_id} waits again: stage encode has no ready replica" in caplog.text
