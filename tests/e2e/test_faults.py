"""Faults against `omnipipe serve`, end to end: a worker killed (kill -9) or frozen
(SIGSTOP) in the middle of a request, more requests than the queues allow, and a flood
of a worker's transfer mailbox. Each test asserts a clean OpenAI-shaped error within the
router's timeout, that every stage's engine is free again (running + waiting back to 0
on each worker's /ready), and that the next request succeeds.

A client that disconnects mid-request is covered in test_images.py (image pipeline) and
test_omni.py (every omni stage)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import torch

from omnipipe.api.constants import CREDENTIAL_ENV, CREDENTIAL_HEADER
from omnipipe.transfer import Message, TransferRefused, make_sender
from tests.e2e.conftest import Served, rss_kib, start_serve, stop_cleanly, write_pipeline

pytestmark = pytest.mark.timeout(300)
CREDENTIAL = "faults-pipeline-credential"
MAILBOX_BYTES = 8 << 20
# Long enough for a few small images at once on a loaded 2-core machine; short enough
# that waiting for the 504 of a frozen worker is cheap.
IMAGE_TIMEOUT_S = 20.0
MAX_QUEUE = 2
FAST = {"num_inference_steps": 2}
# The most denoising a request may ask for, at a size that makes it take far longer than
# the test needs: the request is still running when the fault comes.
ENDLESS = {"num_inference_steps": 200}
IMAGE = "faults-image"
OMNI = "faults-omni"
OMNI_MANIFEST = f"""apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {{name: {OMNI}}}
spec:
  model: tiny://qwen2.5-omni
  pipeline: qwen2.5-omni
  stages:
    - name: thinker
      sampling: {{maxTokens: 8, minTokens: 8}}
    - name: talker
      sampling: {{maxTokens: 30, minTokens: 30}}
"""
HELLO = [{"role": "user", "content": "hello"}]
OMNI_TIMEOUT_S = 20.0
LONG = {"max_tokens": 4000, "min_tokens": 4000}
# A restarted worker loads its model again: the vLLM thinker takes longest.
RESTART_TIMEOUT_S = 150.0


def serve_image(directory: Path, transfer: str) -> Served:
    directory.mkdir(exist_ok=True)
    return start_serve(
        write_pipeline(directory, IMAGE, transfer=transfer),
        env={
            "OMNIPIPE_ROUTER_REQUEST_TIMEOUT_SECONDS": str(IMAGE_TIMEOUT_S),
            "OMNIPIPE_ROUTER_MAX_QUEUE_PER_REPLICA": str(MAX_QUEUE),
            "OMNIPIPE_WORKER_MAILBOX_MAX_BYTES": str(MAILBOX_BYTES),
            CREDENTIAL_ENV: CREDENTIAL,
        },
    )


@pytest.fixture(scope="module")
def image(tmp_module: Path) -> Iterator[Served]:
    s = serve_image(tmp_module / "tcp", "tcp")
    yield s
    stop_cleanly(s)


@pytest.fixture
def ucx_image(tmp_path: Path) -> Iterator[Served]:
    """The same pipeline over the default transfer, for what each backend does itself
    (only while the test that needs it runs: two pipelines at once load a 2-core CI)."""
    s = serve_image(tmp_path / "ucx", "ucx")
    yield s
    stop_cleanly(s)


@pytest.fixture(scope="module")
def omni(tmp_module: Path) -> Iterator[Served]:
    manifest = tmp_module / f"{OMNI}.yaml"
    manifest.write_text(OMNI_MANIFEST)
    s = start_serve(manifest, env={"OMNIPIPE_ROUTER_REQUEST_TIMEOUT_SECONDS": str(OMNI_TIMEOUT_S)})
    yield s
    stop_cleanly(s)


def client(served: Served, timeout: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=served.base_url, api_key="unused", max_retries=0, timeout=openai.Timeout(timeout)
    )


def stage_workers(served: Served) -> list[str]:
    return [name for name in served.workers if name != "router"]


def ready_status(served: Served, worker: str) -> dict[str, Any]:
    """The worker's /ready body (also sent with 503 while it is not ready)."""
    try:
        with urllib.request.urlopen(f"{served.workers[worker][0]}/ready", timeout=5) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as exc:
        return dict(json.loads(exc.read()))


def cancel_on(served: Served, worker: str, request_id: str) -> None:
    """What the router asks of a worker when a request failed elsewhere: to end it,
    which drops the inputs it holds for it."""
    call = urllib.request.Request(
        f"{served.workers[worker][0]}/v1/requests/{request_id}/cancel",
        method="POST",
        headers={CREDENTIAL_HEADER: CREDENTIAL},
    )
    with urllib.request.urlopen(call, timeout=5) as r:
        assert json.loads(r.read()) == {"cancelled": False}  # no job ran it: inputs only


def load(served: Served, worker: str) -> int:
    status = ready_status(served, worker)
    return int(status["running"]) + int(status["waiting"])


def wait_freed(served: Served, timeout: float = 20.0) -> None:
    """Every stage worker reports nothing running or waiting, within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            loads = {w: load(served, w) for w in stage_workers(served)}
        except (OSError, ValueError) as exc:  # a worker restarting
            loads = {"unreachable": str(exc)}  # type: ignore[dict-item]
        if all(v == 0 for v in loads.values()):
            return
        assert time.monotonic() < deadline, f"engines still hold requests: {loads}"
        time.sleep(0.2)


def wait_restarted(served: Served, worker: str, old_pid: int) -> None:
    """omnipipe serve starts a new process for the dead worker, and it turns ready."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while served.workers[worker][1] == old_pid:
        assert time.monotonic() < deadline, "".join(served.output[-20:])
        time.sleep(0.2)
    while True:
        try:
            if ready_status(served, worker)["ready"]:
                return
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, "".join(served.output[-20:])
        time.sleep(0.5)


def one_image(served: Served) -> None:
    with client(served) as c:
        r = c.images.generate(model=IMAGE, prompt="next", size="32x32", extra_body=FAST)
    assert r.data[0].b64_json


def one_chat(served: Served) -> None:
    with client(served) as c:
        r = c.chat.completions.create(
            model=OMNI,
            modalities=["text", "audio"],
            audio={"voice": "Chelsie", "format": "wav"},
            messages=HELLO,
        )
    message = r.choices[0].message
    assert message.content
    assert message.audio is not None
    assert message.audio.data


def in_background(call: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def endless_image(served: Served) -> Callable[[], object]:
    def call() -> object:
        with client(served) as c:
            return c.images.generate(
                model=IMAGE, prompt="endless", size="1024x1024", extra_body=ENDLESS
            )

    return call


def wait_busy(served: Served, worker: str, errors: list[BaseException]) -> None:
    """The worker runs a request (or the request failed before it got there)."""
    deadline = time.monotonic() + 60
    while served.metric(worker, "omnipipe_stage_requests_running") == 0:
        assert not errors, errors
        assert time.monotonic() < deadline, f"{worker} never started the request"
        time.sleep(0.05)


def assert_openai_error(exc: BaseException, status: int, kind: str) -> None:
    assert isinstance(exc, openai.APIStatusError), repr(exc)
    assert exc.status_code == status, exc
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == kind, body


# ---- the image pipeline ---------------------------------------------------------------


def burst(served: Served, n: int) -> list[object]:
    """n small image requests at once: each answer, or the APIStatusError it raised."""
    start = threading.Barrier(n)
    answers: list[object] = []
    lock = threading.Lock()

    def request() -> None:
        with client(served) as c:
            start.wait(timeout=30)
            try:
                r: object = c.images.generate(
                    model=IMAGE, prompt="busy", size="64x64", extra_body={"num_inference_steps": 4}
                )
            except openai.APIStatusError as exc:
                r = exc
        with lock:
            answers.append(r)

    threads = [threading.Thread(target=request, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=IMAGE_TIMEOUT_S + 30)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert len(answers) == n
    return answers


def test_overload_is_429_with_retry_after_and_nothing_accepted_is_lost(image: Served) -> None:
    """Four times as many concurrent requests as a replica may hold at each stage: those
    past the limit are refused at once with 429 and Retry-After; every accepted one
    finishes. A burst whose requests all fit (each finished before the next came: not
    overload) is sent again, a few times at most."""
    refused: list[openai.APIStatusError] = []
    for _ in range(3):
        answers = burst(image, 4 * MAX_QUEUE)
        refused = [a for a in answers if isinstance(a, openai.APIStatusError)]
        served = [a for a in answers if not isinstance(a, openai.APIStatusError)]
        for exc in refused:
            assert_openai_error(exc, 429, "rate_limit_error")
            assert exc.response.headers.get("retry-after") == "1"
        assert len(served) >= MAX_QUEUE, answers
        assert all(r.data[0].b64_json for r in served)  # type: ignore[attr-defined]
        if refused:
            break
    assert refused, "no request was refused"
    wait_freed(image)
    one_image(image)


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
def test_mailbox_flood_is_refused_and_memory_stays_bounded(
    backend: str, request: pytest.FixtureRequest
) -> None:
    image: Served = request.getfixturevalue("image" if backend == "tcp" else "ucx_image")
    worker = "denoise-0"
    address = ready_status(image, worker)["transfer_address"]
    pid = image.workers[worker][1]
    before = rss_kib(pid)
    mib = 1 << 20
    sent = held = 0
    reasons: set[str] = set()
    kept: list[str] = []  # the requests whose inputs the mailbox took

    def message(request_id: str, nbytes: int) -> Message:
        return Message(request_id, "encode", {"x": torch.zeros(nbytes, dtype=torch.uint8)})

    async def flood() -> tuple[int, int]:
        nonlocal sent, held
        outsider = make_sender(backend, credential="not-the-pipeline-credential")
        try:
            for i in range(16):
                with pytest.raises(TransferRefused, match="refused the pipeline credential"):
                    await outsider.send(address, message(f"outsider-{i}", mib))
        finally:
            await outsider.close()
        peer = make_sender(backend, credential=CREDENTIAL)
        accepted = refused = 0
        try:
            # Megabytes far past the cap, then ever smaller messages, as a flooder that
            # fills the mailbox to the last byte would.
            for size, count in ((mib, 64), (64 << 10, 160), (4 << 10, 160), (256, 160)):
                for i in range(count):
                    try:
                        await peer.send(address, message(f"flood-{size}-{i}", size))
                        kept.append(f"flood-{size}-{i}")
                        accepted += 1
                        held += size
                    except TransferRefused as exc:
                        reasons.add(str(exc).partition(": ")[2][:12])
                        refused += 1
                        if size < mib:
                            break  # full at this size: on to a smaller one
                    sent += size
        finally:
            await peer.close()
        return accepted, refused

    accepted, refused = asyncio.run(asyncio.wait_for(flood(), timeout=120))
    assert reasons == {"mailbox full"}
    assert sent > 4 * MAILBOX_BYTES
    # Filled as far as it lets a flooder (to the byte, at the smallest size), never past
    # the cap.
    assert MAILBOX_BYTES // 2 < held <= MAILBOX_BYTES, held
    assert refused >= 64 - MAILBOX_BYTES // mib, (accepted, refused)
    grown = (rss_kib(pid) - before) * 1024
    assert grown < 4 * MAILBOX_BYTES, f"RSS of {worker} grew by {grown / mib:.0f} MiB"
    # The worker is still alive, and a real request still gets through its mailbox.
    assert image.workers[worker][1] == pid
    one_image(image)
    wait_freed(image)
    # Left alone, the flood holds the unclaimed share until the sweep (2 to 2.5 min), and
    # the tests after this one on the module's serve inherit it: a request whose input
    # reaches denoise before its submission does is then refused (a 503 "mailbox full"
    # in test_sigstop_of_denoise_mid_request_is_504_then_the_engine_frees, under
    # pytest-xdist beside another suite). Cancelled, as the router cancels a request
    # that failed elsewhere, its inputs go, and the share takes a megabyte again.
    for request_id in kept:
        cancel_on(image, worker, request_id)

    async def one_unclaimed_megabyte() -> None:
        peer = make_sender(backend, credential=CREDENTIAL)
        try:
            await peer.send(address, message("after-the-flood", mib))
        finally:
            await peer.close()

    asyncio.run(asyncio.wait_for(one_unclaimed_megabyte(), timeout=60))
    cancel_on(image, worker, "after-the-flood")


def test_a_client_gone_mid_request_frees_every_stage(image: Served) -> None:
    """The client hangs up while denoise runs: encode, denoise and the decode waiting for
    latents all let the request go, and the next one is served."""
    url = urlsplit(image.base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    body = {"model": IMAGE, "prompt": "gone", "size": "1024x1024", **ENDLESS}
    conn.request(
        "POST",
        "/v1/images/generations",
        json.dumps(body),
        {"Content-Type": "application/json", "Authorization": "Bearer unused"},
    )
    try:
        wait_busy(image, "denoise-0", [])
    finally:
        conn.close()
    wait_freed(image, timeout=10)
    one_image(image)


def test_sigstop_of_denoise_mid_request_is_504_then_the_engine_frees(image: Served) -> None:
    worker = "denoise-0"
    started = time.monotonic()
    t, errors = in_background(endless_image(image))
    wait_busy(image, worker, errors)
    pid = image.workers[worker][1]
    os.kill(pid, signal.SIGSTOP)
    try:
        t.join(timeout=IMAGE_TIMEOUT_S + 30)
        assert not t.is_alive(), "the client hung on a frozen worker"
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert errors, "the client got no error"
    assert_openai_error(errors[0], 504, "timeout")
    assert took < IMAGE_TIMEOUT_S + 10, took
    # Thawed, it learns that the router gave up, and stops denoising.
    wait_freed(image)
    assert image.workers[worker][1] == pid  # frozen is not dead: nothing restarted it
    one_image(image)


def test_kill_9_of_denoise_mid_request_is_503_then_it_restarts(image: Served) -> None:
    worker = "denoise-0"
    t, errors = in_background(endless_image(image))
    wait_busy(image, worker, errors)
    pid = image.workers[worker][1]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    t.join(timeout=IMAGE_TIMEOUT_S + 30)
    assert not t.is_alive(), "the client hung after its worker died"
    assert errors, "the client got no error"
    assert_openai_error(errors[0], 503, "service_unavailable")
    assert time.monotonic() - killed < IMAGE_TIMEOUT_S
    wait_restarted(image, worker, pid)
    wait_freed(image)
    one_image(image)


# ---- the omni pipeline (thinker on vLLM) ----------------------------------------------


def drain(chunks: Iterator[object]) -> None:
    """Read what is still on the way (text and audio deltas), bounded."""
    for _ in range(100_000):
        next(chunks)


def long_audio_stream(served: Served, c: openai.OpenAI) -> Iterator[Any]:
    """A streamed text and audio chat far longer than the test, read until every stage
    holds it (the talker runs only once the thinker's text flows)."""
    stream = c.chat.completions.create(
        model=OMNI,
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"},
        messages=HELLO,  # type: ignore[arg-type]
        stream=True,
        extra_body={"sampling_params_list": [LONG, LONG]},
    )
    chunks = iter(stream)
    deadline = time.monotonic() + 60
    while served.metric("talker-0", "omnipipe_stage_requests_running") == 0:
        next(chunks)
        assert time.monotonic() < deadline, "the talker never started"
    return chunks


def test_sigstop_of_the_thinker_mid_stream_is_504_then_the_engine_frees(omni: Served) -> None:
    worker = "thinker-0"
    started = time.monotonic()
    with client(omni, timeout=120) as c:
        chunks = long_audio_stream(omni, c)
        pid = omni.workers[worker][1]
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(openai.APIError) as err:
                drain(chunks)
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
    assert took < OMNI_TIMEOUT_S + 10, took
    assert isinstance(err.value.body, dict), err.value
    assert err.value.body["type"] == "timeout", err.value.body
    # Thawed, the thinker learns that the router gave up and aborts the request in its
    # vLLM engine; the talker and code2wav were cancelled already.
    wait_freed(omni)
    assert omni.workers[worker][1] == pid
    one_chat(omni)


def test_kill_9_of_the_thinker_mid_stream_is_503_then_it_restarts(omni: Served) -> None:
    worker = "thinker-0"
    with client(omni, timeout=120) as c:
        chunks = long_audio_stream(omni, c)
        pid = omni.workers[worker][1]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as err:
            drain(chunks)
    assert time.monotonic() - killed < OMNI_TIMEOUT_S
    # Mid-stream the status line is long gone: the error is an SSE event, in OpenAI's shape.
    assert isinstance(err.value.body, dict), err.value
    assert err.value.body["type"] == "service_unavailable", err.value.body
    assert "thinker" in err.value.body["message"]
    wait_restarted(omni, worker, pid)
    wait_freed(omni)
    one_chat(omni)
