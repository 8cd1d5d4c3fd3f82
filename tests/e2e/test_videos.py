"""/v1/videos through two router replicas that share one Redis, as a user runs them:
`omnipipe serve` of tiny://wan (its router answers the API and runs no jobs) and a
second router on the same stages (the one that runs them), each started with the same
OMNIPIPE_ROUTER_VIDEO_STORE. A job made through one is polled, downloaded, listed and
deleted through the other; a router killed mid-job loses nothing: a router started in its
place runs the job to the end."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import httpx
import openai
import pytest

from omnipipe.local.ports import free_port
from omnipipe.local.video_store import start_redis
from tests.e2e.conftest import Served, start_serve, stop_cleanly

pytestmark = [
    pytest.mark.timeout(600),
    # openai marks client.videos deprecated (OpenAI's own Sora API ends); the calls and
    # their shapes are what a client of /v1/videos sends, whoever serves it.
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
]
MANIFEST = """\
apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: video}
spec:
  model: tiny://wan
  pipeline: wan
"""
CREDENTIAL = "videos-e2e-credential"
# Short, so that the test of a killed router is quick; renewed every 2 s, which a loaded
# CI machine keeps up with.
LEASE_SECONDS = "6"
# Sent as the openai client sends extensions: form fields beside prompt, size, seconds.
SMALL = {"num_frames": 9, "fps": 8, "num_inference_steps": 4}
# Long enough to be caught mid-run: 15 s on an idle 2-core machine, in steps of 70 ms.
LONG = {"num_frames": 17, "fps": 8, "num_inference_steps": 200}
LONG_SIZE = "256x256"
# Twice that: a delete that did not stop it would leave the denoiser busy long after.
LONGER = {**LONG, "num_frames": 33}
# How soon a deleted job leaves the denoiser: the replica running it sees the delete at
# its next renewal (2 s) and the denoiser drops it at its next step.
FREED_WITHIN_SECONDS = 8


@dataclass
class Cluster:
    served: Served
    second: subprocess.Popen[bytes]
    second_url: str
    router_argv: list[str]
    env: dict[str, str]


def router_argv(served: Served, port: int) -> list[str]:
    """A second router on the files the first one's command line names (the pipeline
    snapshot and the replicas file `omnipipe serve` keeps current)."""
    pid = served.workers["router"][1]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    at = argv.index("--port") + 1
    return [*argv[:at], str(port), *argv[at + 1 :]]


def start_router(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2):
                return proc
        except OSError:
            assert proc.poll() is None, "the second router exited"
            assert time.monotonic() < deadline, "the second router never turned ready"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_module: Path) -> Iterator[Cluster]:
    redis_proc, url = start_redis(tmp_module / "redis")
    manifest = tmp_module / "video.yaml"
    manifest.write_text(MANIFEST)
    common = {
        "OMNIPIPE_ROUTER_VIDEO_STORE": url,
        "OMNIPIPE_ROUTER_VIDEO_LEASE_SECONDS": LEASE_SECONDS,
        "OMNIPIPE_PIPELINE_CREDENTIAL": CREDENTIAL,
    }
    served = start_serve(manifest, env={**common, "OMNIPIPE_ROUTER_VIDEO_JOBS_PER_REPLICA": "0"})
    env = {**os.environ, **common}
    port = free_port()
    argv = router_argv(served, port)
    second = start_router(argv, env)
    made = Cluster(served, second, f"http://127.0.0.1:{port}/v1", argv, env)
    try:
        yield made
    finally:
        made.second.terminate()
        made.second.wait(30)
        stop_cleanly(served)
        redis_proc.terminate()
        redis_proc.wait(10)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def first(cluster: Cluster) -> Iterator[openai.OpenAI]:
    """A client of `omnipipe serve`'s router, which runs no jobs."""
    with client(cluster.served.base_url) as c:
        yield c


@pytest.fixture
def second(cluster: Cluster) -> Iterator[openai.OpenAI]:
    """A client of the second router, which runs them."""
    with client(cluster.second_url) as c:
        yield c


def wait_status(
    c: openai.OpenAI,
    video_id: str,
    wanted: set[str],
    timeout: float,
    progress: list[int] | None = None,
) -> Any:
    """The job once its status is one of `wanted`; its progress only grows on the way,
    unless the caller keeps the readings (`progress`) to judge them itself."""
    deadline = time.monotonic() + timeout
    seen: list[int] = [] if progress is None else progress
    while True:
        video = c.videos.retrieve(video_id)
        seen.append(video.progress)
        if video.status in wanted:
            assert progress is not None or seen == sorted(seen), f"progress went back: {seen}"
            return video
        assert video.status in ("queued", "in_progress"), video
        assert time.monotonic() < deadline, f"still {video.status} after {timeout}s"
        time.sleep(0.2)


def test_a_job_made_through_one_router_is_served_whole_by_the_other(
    first: openai.OpenAI, second: openai.OpenAI
) -> None:
    video = first.videos.create(prompt="a lighthouse", size="64x48", extra_body=SMALL)  # type: ignore[arg-type]
    assert (video.object, video.status, video.size, video.seconds) == (
        "video",
        "queued",
        "64x48",
        "1",
    )
    done = wait_status(second, video.id, {"completed", "failed"}, timeout=120)
    assert done.status == "completed", done.error
    assert done.progress == 100
    assert done.expires_at is not None
    assert done.completed_at is not None
    mp4 = second.videos.download_content(video.id).read()
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(frames) == 9
    assert frames[0].shape == (48, 64, 3)
    # The first router lists and downloads what the second one finished.
    assert video.id in [v.id for v in first.videos.list(limit=100)]
    assert first.videos.download_content(video.id).read() == mp4
    deleted = first.videos.delete(video.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        second.videos.retrieve(video.id)


def test_bad_requests_are_openai_shaped_4xx(cluster: Cluster, second: openai.OpenAI) -> None:
    base = cluster.served.base_url
    cases = [
        ({"prompt": "x", "size": "65x48"}, 400, "size"),
        ({"prompt": "x", "size": "4096x48"}, 400, "size"),
        ({"prompt": "x", "num_frames": 10}, 400, "num_frames"),
        ({"prompt": "x", "num_frames": 1000}, 400, "num_frames"),
        ({"prompt": "x", "seconds": "600"}, 400, "seconds"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "x", "model": "nope"}, 404, "model"),
    ]
    for body, status, param in cases:
        r = httpx.post(f"{base}/videos", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    # Inside the API's bounds, past tiny://wan's DiT (its rotary positions reach 1024
    # pixels a side and 253 frames): the model's limit, named at create, and no job made.
    before = {v.id for v in second.videos.list()}
    model_limits = [
        (
            {"prompt": "x", "size": "1040x48"},
            "size",
            "width 1040: this model's DiT places at most 1024 pixels a side",
        ),
        (
            {"prompt": "x", "size": "48x1280"},
            "size",
            "height 1280: this model's DiT places at most 1024 pixels a side",
        ),
        (
            {"prompt": "x", "num_frames": 257},
            "num_frames",
            "num_frames 257: this model's DiT places at most 253 frames",
        ),
        (
            {"prompt": "x", "seconds": "32", "fps": 8},
            "seconds",
            "num_frames 257: this model's DiT places at most 253 frames",
        ),
    ]
    for body, param, message in model_limits:
        r = httpx.post(f"{base}/videos", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"] == {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }, body
    assert {v.id for v in second.videos.list()} == before
    unknown = httpx.get(f"{base}/videos/video_{'0' * 32}", timeout=30)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["param"] == "video_id"
    # Content before completion: a queued job's content is a 409, not a 5xx or a wait.
    video = second.videos.create(prompt="x", size=LONG_SIZE, extra_body=LONG)  # type: ignore[arg-type]
    early = httpx.get(f"{base}/videos/{video.id}/content", timeout=30)
    assert early.status_code == 409, early.text
    assert "content is there once completed" in early.json()["error"]["message"]
    second.videos.delete(video.id)


def running_on_denoise(served: Served) -> float:
    return served.metric("denoise-0", "omnipipe_stage_requests_running")


def test_deleting_a_running_job_frees_the_denoiser(cluster: Cluster, second: openai.OpenAI) -> None:
    video = second.videos.create(prompt="a long one", size=LONG_SIZE, extra_body=LONGER)  # type: ignore[arg-type]
    deadline = time.monotonic() + 60
    while running_on_denoise(cluster.served) == 0 or second.videos.retrieve(video.id).progress == 0:
        assert time.monotonic() < deadline, "the denoiser never started the job"
        time.sleep(0.2)
    progress = second.videos.retrieve(video.id).progress
    second.videos.delete(video.id)
    deleted = time.monotonic()
    with pytest.raises(openai.NotFoundError):
        second.videos.retrieve(video.id)
    while running_on_denoise(cluster.served) > 0:
        assert time.monotonic() - deleted < FREED_WITHIN_SECONDS, (
            f"the denoiser still runs the job deleted at {progress}%"
        )
        time.sleep(0.2)
    # It stopped, not finished: the job had most of its steps to go.
    assert progress < 50


def test_a_router_killed_mid_job_loses_nothing(cluster: Cluster, first: openai.OpenAI) -> None:
    video = first.videos.create(prompt="survive", size=LONG_SIZE, extra_body=LONG)  # type: ignore[arg-type]
    deadline = time.monotonic() + 60
    while first.videos.retrieve(video.id).progress == 0:
        assert time.monotonic() < deadline, "the job never progressed"
        time.sleep(0.1)
    cluster.second.send_signal(signal.SIGKILL)
    cluster.second.wait()
    # Nothing runs the job now: it stays unfinished (queued again once its lease runs out).
    assert first.videos.retrieve(video.id).status in ("in_progress", "queued")
    # A replica started in the dead one's place (a Deployment's new pod).
    cluster.second = start_router(cluster.router_argv, cluster.env)
    progress: list[int] = []
    done = wait_status(first, video.id, {"completed", "failed"}, 180, progress)
    assert done.status == "completed", done.error
    # It ran again from its first step, and to its last: its progress went back once.
    drops = [i for i in range(1, len(progress)) if progress[i] < progress[i - 1]]
    assert len(drops) == 1, progress
    assert progress[drops[0] :] == sorted(progress[drops[0] :]), progress
    assert len(first.videos.download_content(video.id).read()) > 0
