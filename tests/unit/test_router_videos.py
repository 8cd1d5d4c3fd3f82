"""The video API over a real redis-server: a store that stops answering is a 503 in
OpenAI's shape with Retry-After (never a 500 or a hang), and the job is there again once
the store is back; a job queued while no replica runs jobs stays queued."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from omnipipe.api import ResolvedPipeline, parse_resource, resolve
from omnipipe.local.video_store import start_redis
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings

pytestmark = pytest.mark.timeout(60)


def wan(videos: dict[str, Any]) -> ResolvedPipeline:
    return resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "v"},
                "spec": {"model": "tiny://wan", "pipeline": "wan", "videos": videos},
            }
        )
    )


# The resource's TTL is what the router keeps things for.
PIPELINE = wan({"ttlSeconds": 120})
SMALL = {"prompt": "x", "size": "64x48", "num_frames": 9, "num_inference_steps": 2}


@contextmanager
def running_router(
    tmp_path: Path, pipeline: ResolvedPipeline, **settings: Any
) -> Iterator[tuple[TestClient, str]]:
    """The pipeline's router (no stage replicas) on a redis-server of its own, and the
    server's URL."""
    server, url = start_redis(tmp_path / "redis")
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({"stages": {s.name: [] for s in pipeline.stages}}))
    config = RouterSettings(replicas_file=str(replicas), video_store=url, **settings)
    try:
        with TestClient(build_app(pipeline, config)) as client:
            yield client, url
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture
def api(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[TestClient, Path]]:
    """The router, as many job takers as the test's parameter says (none by default)."""
    takers = getattr(request, "param", 0)
    settings = {"video_jobs_per_replica": takers, "wake_wait_seconds": 0.2}
    with running_router(tmp_path, PIPELINE, **settings) as (client, _):
        yield client, tmp_path / "redis"


def test_a_store_that_stops_answering_is_a_503_and_the_job_outlives_it(
    api: tuple[TestClient, Path],
) -> None:
    client, folder = api
    made = client.post("/v1/videos", json=SMALL)
    assert made.status_code == 200, made.text
    video_id = made.json()["id"]
    assert client.get(f"/v1/videos/{video_id}").json()["status"] == "queued"
    # The store goes away: the job is saved to disk first, so a store that comes back
    # with its data (as a Redis with persistence does) has it.
    store = redis.Redis(unix_socket_path=str(folder / "redis.sock"))
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
    back, _ = start_redis(folder)
    try:
        job = client.get(f"/v1/videos/{video_id}")
        assert job.status_code == 200, job.text
        assert job.json()["status"] == "queued"
    finally:
        back.terminate()
        back.wait(10)


def test_a_deleted_job_is_gone_at_once_and_a_held_one_is_told_to_stop(
    api: tuple[TestClient, Path],
) -> None:
    """A queued job is simply gone; one a runner holds also gets the flag that stops
    it, kept for the resource's TTL."""
    client, folder = api
    store = redis.Redis(unix_socket_path=str(folder / "redis.sock"))
    key = "omnipipe:videos:{default/v}:"
    queued, held = (client.post("/v1/videos", json=SMALL).json()["id"] for _ in range(2))
    # What a runner does as it takes the second job: off the queue, under its lease.
    assert store.lrem(f"{key}queue", 0, held) == 1
    store.set(f"{key}lease:{held}", "a-runner", px=60_000)
    for video_id in (queued, held):
        assert client.delete(f"/v1/videos/{video_id}").json() == {
            "id": video_id,
            "object": "video.deleted",
            "deleted": True,
        }
        assert client.get(f"/v1/videos/{video_id}").status_code == 404
    assert client.get("/v1/videos").json()["data"] == []
    assert store.llen(f"{key}queue") == 0
    assert store.exists(f"{key}cancel:{queued}") == 0
    assert 110 < store.ttl(f"{key}cancel:{held}") <= 120


def test_a_body_nested_past_the_parser_is_a_400(api: tuple[TestClient, Path]) -> None:
    client, _ = api
    deep = client.post(
        "/v1/videos", content=b"[" * 100_000, headers={"content-type": "application/json"}
    )
    assert deep.status_code == 400, deep.text
    assert deep.json()["error"]["message"] == "the body must be JSON or a multipart form"


@pytest.mark.parametrize("api", [1], indirect=True)
def test_a_job_no_stage_can_take_waits_in_the_queue_and_does_not_fail(
    api: tuple[TestClient, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Every stage at zero replicas (a cluster waking its GPUs): the job is taken, finds
    no replica, and goes back to the queue, again and again, never failing meanwhile."""
    client, _ = api
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


async def test_a_client_that_hangs_up_mid_body_is_a_400_not_a_router_error(
    tmp_path: Path,
) -> None:
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({"stages": {s.name: [] for s in PIPELINE.stages}}))
    app = build_app(
        PIPELINE, RouterSettings(replicas_file=str(replicas), video_store="redis://127.0.0.1:1")
    )
    arriving = [
        {"type": "http.request", "body": b'{"prompt": "a c', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return arriving.pop(0) if arriving else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/videos",
        "raw_path": b"/v1/videos",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"40")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5000),
        "root_path": "",
    }
    await app(scope, receive, send)
    assert sent[0]["status"] == 400
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["error"]["message"] == "the client went away before its request body arrived"


def test_an_idempotency_key_makes_one_job_however_often_it_is_sent(
    api: tuple[TestClient, Path],
) -> None:
    """A create retried with its Idempotency-Key (after a 503, a timeout) is the job the
    key made; the key with another request is a 409; without a key, each create is a job;
    a key whose job was deleted makes a new one."""
    client, folder = api
    once = {"Idempotency-Key": "retry-me"}
    first = client.post("/v1/videos", json=SMALL, headers=once)
    assert first.status_code == 200, first.text
    # A runner has taken it (its private run count): the answer to a retry is the public
    # object, as GET gives it.
    store = redis.Redis(unix_socket_path=str(folder / "redis.sock"))
    [key] = store.keys(f"*:job:{first.json()['id']}")
    store.set(key, json.dumps({**json.loads(store.get(key) or b"{}"), "_runs": 1}))
    again = client.post("/v1/videos", json=SMALL, headers=once)
    assert again.status_code == 200, again.text
    assert again.json() == client.get(f"/v1/videos/{first.json()['id']}").json()
    assert "_runs" not in again.json()
    # The same request as the openai client's multipart form is the same request.
    form = {k: (None, str(v)) for k, v in SMALL.items()}
    as_form = client.post("/v1/videos", files=form, headers=once)
    assert as_form.status_code == 200, as_form.text
    assert as_form.json()["id"] == first.json()["id"]
    other = client.post("/v1/videos", json={**SMALL, "prompt": "y"}, headers=once)
    assert other.status_code == 409, other.text
    assert other.json()["error"]["param"] == "Idempotency-Key"
    assert first.json()["id"] in other.json()["error"]["message"]
    plain = [client.post("/v1/videos", json=SMALL).json()["id"] for _ in range(2)]
    assert len(set(plain)) == 2
    listed = {v["id"] for v in client.get("/v1/videos", params={"limit": 100}).json()["data"]}
    assert listed == {first.json()["id"], *plain}
    assert client.delete(f"/v1/videos/{first.json()['id']}").status_code == 200
    after = client.post("/v1/videos", json=SMALL, headers=once)
    assert after.status_code == 200, after.text
    assert after.json()["id"] != first.json()["id"]
    for bad in ("", "x" * 256):
        refused = client.post("/v1/videos", json=SMALL, headers={"Idempotency-Key": bad})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "Idempotency-Key"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/omni/generate", {"model": "v", "prompt": "x"}),
        ("/v1/images/generations", {"model": "v", "prompt": "x", "size": "99999x99999"}),
        ("/v1/chat/completions", {"model": "v", "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/audio/speech", {"model": "v", "input": "x"}),
        ("/v1/images/edits", {}),
    ],
)
def test_the_synchronous_endpoints_point_at_the_video_jobs(
    api: tuple[TestClient, Path], path: str, body: dict[str, Any]
) -> None:
    """A video pipeline runs a video only as a job: a synchronous endpoint answers at once
    with a 400 naming /v1/videos, and starts nothing (no job, no stage call)."""
    client, _ = api
    started = time.monotonic()
    refused = client.post(path, json=body)
    assert time.monotonic() - started < 5
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "model"
    assert "POST /v1/videos" in error["message"]
    assert client.get("/v1/videos").json()["data"] == []
    assert path not in client.get("/openapi.json").json()["paths"]


# Takes no jobs, and its sweep waits minutes: a test calls it.
QUIET = {"video_jobs_per_replica": 0, "video_lease_seconds": 600}


def test_creates_past_the_unfinished_limit_are_429_with_retry_after(tmp_path: Path) -> None:
    """spec.videos.maxUnfinishedJobs bounds the queue across routers: a create past it
    is refused in OpenAI's shape, makes nothing, and a retry with the key of a job it made
    still finds that job; a job finished or deleted makes room."""
    with running_router(tmp_path, wan({"maxUnfinishedJobs": 3}), **QUIET) as (client, _):
        once = {"Idempotency-Key": "first"}
        made = [client.post("/v1/videos", json=SMALL, headers=once)]
        made += [client.post("/v1/videos", json=SMALL) for _ in range(2)]
        assert [m.status_code for m in made] == [200, 200, 200]
        for _ in range(3):
            full = client.post("/v1/videos", json=SMALL)
            assert full.status_code == 429, full.text
            assert full.headers["Retry-After"] == "60"
            assert full.json()["error"]["type"] == "rate_limit_error"
            assert "3 video jobs are queued or running" in full.json()["error"]["message"]
        retried = client.post("/v1/videos", json=SMALL, headers=once)
        assert retried.status_code == 200, retried.text
        assert retried.json()["id"] == made[0].json()["id"]
        listed = client.get("/v1/videos", params={"limit": 100}).json()["data"]
        assert len(listed) == 3
        assert client.delete(f"/v1/videos/{made[1].json()['id']}").status_code == 200
        assert client.post("/v1/videos", json=SMALL).status_code == 200
        assert client.post("/v1/videos", json=SMALL).status_code == 429


def test_a_sweep_costs_a_few_round_trips_however_long_the_queue(tmp_path: Path) -> None:
    """60,000 queued jobs once made each sweep claim each job in turn, scanning the whole
    queue each time (quadratic). Now a sweep of thousands of queued jobs is a handful of
    Redis commands, and one that lost its runner is still found and queued again."""
    queued = 3000
    pipeline = wan({"maxUnfinishedJobs": queued + 10})
    with running_router(tmp_path, pipeline, **QUIET) as (client, url):
        runner = client.app.state.videos  # type: ignore[attr-defined]
        store = runner.store
        for i in range(queued):
            job = {"id": f"video_{i:032x}", "status": "queued", "created_at": int(time.time())}
            client.portal.call(store.create, job, {})
        raw = redis.Redis.from_url(url)
        key = "omnipipe:videos:{default/v}:"
        # Two jobs a runner took and lost (off the queue, no lease), one it still holds.
        lost = [f"video_{i:032x}" for i in (7, 1500)]
        held = f"video_{2999:032x}"
        for video_id in (*lost, held):
            raw.lrem(f"{key}queue", 0, video_id)
            raw.srem(f"{key}queued", video_id)
        raw.set(f"{key}lease:{held}", "another-runner", px=600_000)
        raw.config_resetstat()
        client.portal.call(runner.sweep)
        stats = raw.info("commandstats")
        calls = sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_config")
        # A few commands for the whole set, and a few (with those the scripts run)
        # per lost job; the sweep before made a claim per job: 3,000 scripts.
        assert calls < 60, stats
        assert int(stats["cmdstat_evalsha"]["calls"]) <= 6 * len(lost), stats
        assert "cmdstat_lpos" not in stats
        waiting = [v.decode() for v in raw.lrange(f"{key}queue", 0, -1)]
        assert len(waiting) == queued - 1
        assert waiting[-2:] == lost
        assert held not in waiting
        assert raw.scard(f"{key}queued") == queued - 1


def test_a_json_number_sent_as_text_is_a_400_and_a_forms_text_is_read(
    api: tuple[TestClient, Path],
) -> None:
    client, _ = api
    refused = client.post("/v1/videos", json={**SMALL, "seed": "7"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "seed"
    form = {k: (None, str(v)) for k, v in {**SMALL, "seed": 7}.items()}
    assert client.post("/v1/videos", files=form).status_code == 200


def test_the_limit_reaches_the_routers_file_only_when_set() -> None:
    """The pipeline file the operator writes for the routers carries maxUnfinishedJobs
    when the resource sets it; at its default the file is what it was before the field
    existed, so no router pod rolls for it."""
    assert wan({"maxUnfinishedJobs": 3}).videos.as_config()["videos"]["max_unfinished_jobs"] == 3
    assert "max_unfinished_jobs" not in wan({"ttlSeconds": 120}).videos.as_config()["videos"]
    assert wan({}).videos.as_config() == {}


def test_a_runner_stalled_past_its_lease_takes_it_back_unless_someone_took_the_job(
    tmp_path: Path,
) -> None:
    """A router's loop held up longer than the lease (a hostile body once did it) let the
    lease run out under a runner still at work: its next renewal dropped the job, which a
    sweep then started again from step 0, three times, and failed it. Now the renewal
    takes the lease back, unless a sweep queued or claimed the job, or its client
    deleted it, meanwhile."""
    with running_router(tmp_path, wan({}), **QUIET) as (client, url):
        store = client.app.state.videos.store  # type: ignore[attr-defined]
        raw = redis.Redis.from_url(url)
        key = "omnipipe:videos:{default/v}:"

        def expired_lease(video_id: str) -> None:
            job = {"id": video_id, "status": "queued", "created_at": int(time.time())}
            client.portal.call(store.create, job, {})
            assert client.portal.call(store.take, "runner-a", 50) == video_id
            time.sleep(0.1)
            assert raw.exists(f"{key}lease:{video_id}") == 0

        def renew(video_id: str) -> bool:
            return bool(client.portal.call(store.renew, video_id, "runner-a", 60_000))

        alone, requeued, claimed, deleted = (f"video_{i:032x}" for i in range(4))
        expired_lease(alone)
        assert renew(alone)
        assert raw.get(f"{key}lease:{alone}") == b"runner-a"
        assert renew(alone)  # and renewed as before from then on

        expired_lease(claimed)
        assert client.portal.call(store.claim, claimed, "a-sweep", 60_000)
        assert not renew(claimed)
        assert raw.get(f"{key}lease:{claimed}") == b"a-sweep"

        expired_lease(deleted)
        client.portal.call(store.cancel, deleted, 120)
        assert not renew(deleted)
        assert raw.exists(f"{key}lease:{deleted}") == 0

        # Failed by a sweep (its runs used up) while its runner stalled: not taken back,
        # or the runner's finish would make a failed job completed.
        failed_meanwhile = f"video_{4:032x}"
        expired_lease(failed_meanwhile)
        job = {"id": failed_meanwhile, "status": "failed", "created_at": int(time.time())}
        client.portal.call(store.put, job, 60)
        assert not renew(failed_meanwhile)

        expired_lease(requeued)  # last: the queue's head from then on
        client.portal.call(store.requeue, requeued)
        assert not renew(requeued)
        assert raw.exists(f"{key}lease:{requeued}") == 0


def test_remix_two_keys_and_a_failed_jobs_content_are_each_told_plainly(tmp_path: Path) -> None:
    """What the hostile probe met as confusing answers: remix read as an unknown URL, two
    Idempotency-Key headers settled by the first, and a failed job's content said to come
    'once completed'."""
    with running_router(tmp_path, wan({}), **QUIET) as (client, _):
        made = client.post("/v1/videos", json=SMALL).json()
        remix = client.post(f"/v1/videos/{made['id']}/remix", json={"prompt": "y"})
        assert remix.status_code == 400, remix.text
        assert "remix is not supported" in remix.json()["error"]["message"]
        missing = client.post(f"/v1/videos/video_{'0' * 32}/remix", json={"prompt": "y"})
        assert missing.status_code == 404, missing.text

        two = client.post(
            "/v1/videos",
            json=SMALL,
            headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b")],
        )
        assert two.status_code == 400, two.text
        assert two.json()["error"]["param"] == "Idempotency-Key"

        store = client.app.state.videos.store  # type: ignore[attr-defined]
        failed = {**made, "status": "failed", "error": {"code": "internal", "message": "x"}}
        client.portal.call(store.put, failed, 60)
        content = client.get(f"/v1/videos/{made['id']}/content")
        assert content.status_code == 409, content.text
        assert content.json()["error"]["message"] == f"video {made['id']} failed: it has no content"


def test_fields_no_one_reads_are_logged_by_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Accepted, as newer clients send fields this release does not know, but not in
    silence: the log names each one the family's extensions do not read either."""
    with (
        running_router(tmp_path, wan({}), **QUIET) as (client, _),
        caplog.at_level(logging.INFO, logger="omnipipe.router.api.videos"),
    ):
        made = client.post("/v1/videos", json={**SMALL, "steps": 999, "fps": 8})
    assert made.status_code == 200, made.text
    logged = [r.getMessage() for r in caplog.records if "unknown video fields" in r.getMessage()]
    assert logged == ["ignoring unknown video fields: 'steps'"]


def test_jobs_of_one_second_list_in_the_order_they_were_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """created_at has whole seconds: the list's order within one second is the store's
    creation counter, not the ids' (random) order. Paging after an id keeps to it."""
    with running_router(tmp_path, wan({}), **QUIET) as (client, _):
        monkeypatch.setattr("omnipipe.router.api.videos.time.time", lambda: 1_700_000_000.5)
        made = [client.post("/v1/videos", json=SMALL).json()["id"] for _ in range(8)]
        monkeypatch.undo()
        later = client.post("/v1/videos", json=SMALL).json()["id"]
        oldest_first = client.get("/v1/videos", params={"order": "asc", "limit": 100}).json()
        assert [v["id"] for v in oldest_first["data"]] == [*made, later]
        newest = client.get("/v1/videos", params={"limit": 100}).json()["data"]
        assert [v["id"] for v in newest] == [later, *reversed(made)]
        after = client.get("/v1/videos", params={"order": "asc", "after": made[3]}).json()
        assert [v["id"] for v in after["data"]] == [*made[4:], later]


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("text/plain", 400),
        ("application/x-www-form-urlencoded", 400),  # curl -d without -H
        ("application/xml", 400),
        ("application/json; charset=utf-8", 200),
        ("application/vnd.api+json", 200),
        ("text/x+json", 400),
        (None, 200),
    ],
)
def test_a_json_body_is_read_only_under_a_json_content_type(
    tmp_path: Path, content_type: str | None, status: int
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    with running_router(tmp_path, wan({}), **QUIET) as (client, _):
        made = client.post("/v1/videos", content=json.dumps(SMALL), headers=headers)
    assert made.status_code == status, made.text
    if status == 400:
        message = made.json()["error"]["message"]
        assert message == (
            f"Content-Type {content_type!r}: send application/json or multipart/form-data"
        )
