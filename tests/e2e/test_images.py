"""Text to image through the official openai client against `omnipipe serve`."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from tests.e2e.conftest import Served, start_serve, stop_cleanly, write_pipeline
from tests.harness.usage import expected_usage

pytestmark = pytest.mark.timeout(300)
FAST = {"num_inference_steps": 2}


@pytest.fixture(scope="module")
def served(tmp_module: Path) -> Iterator[Served]:
    manifest = write_pipeline(
        tmp_module, "tiny-image", "  stages:\n    - {name: denoise, replicas: 2}\n"
    )
    s = start_serve(manifest)
    yield s
    stop_cleanly(s)


_clients: list[openai.OpenAI] = []


def client(s: Served, **kw: object) -> openai.OpenAI:
    c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, **kw)  # type: ignore[arg-type]
    _clients.append(c)
    return c


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.pop().close()


def decode(b64: str | None) -> Image.Image:
    assert b64
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_models_lists_the_pipeline(served: Served) -> None:
    ids = [m.id for m in client(served).models.list()]
    assert ids == ["tiny-image"]


def test_image_at_requested_size(served: Served) -> None:
    r = client(served).images.generate(
        model="tiny-image", prompt="a red fox", size="64x48", extra_body=FAST
    )
    [item] = r.data
    img = decode(item.b64_json)
    assert img.format == "PNG"
    assert img.size == (64, 48)


def test_n_two_and_negative_prompt(served: Served) -> None:
    r = client(served).images.generate(
        model="tiny-image",
        prompt="a fox",
        size="32x32",
        n=2,
        extra_body={**FAST, "negative_prompt": "blurry", "seed": 1},
    )
    assert [decode(d.b64_json).size for d in r.data] == [(32, 32), (32, 32)]
    assert r.data[0].b64_json != r.data[1].b64_json
    # In: the prompt's and the negative prompt's tokens. Out: two images of (32/16)^2
    # DiT tokens (8x VAE, 2x2 patches).
    assert r.usage is not None
    assert r.usage.model_dump() == expected_usage("tiny://qwen-image", ["a fox", "blurry"], 2 * 4)


def test_ten_jpegs_and_a_webp_in_the_formats_asked_for_and_the_response_says_so(
    served: Served,
) -> None:
    c = client(served)
    r = c.images.generate(
        model="tiny-image",
        prompt="a fox",
        size="48x32",
        n=10,
        output_format="jpeg",
        output_compression=60,
        background="opaque",
        extra_body={**FAST, "seed": 5},
    )
    assert (r.output_format, r.size, r.background) == ("jpeg", "48x32", "opaque")
    assert len(r.data) == 10
    images = [decode(d.b64_json) for d in r.data]
    assert {(i.format, i.size) for i in images} == {("JPEG", (48, 32))}
    assert len({d.b64_json for d in r.data}) == 10
    webp = c.images.generate(
        model="tiny-image", prompt="a fox", size="48x32", output_format="webp",
        extra_body={**FAST, "seed": 5},
    )  # fmt: skip
    assert (webp.output_format, webp.size) == ("webp", "48x32")
    png = c.images.generate(
        model="tiny-image", prompt="a fox", size="48x32", extra_body={**FAST, "seed": 5}
    )
    assert png.output_format == "png"
    # WebP at the default compression (100) is lossless: the PNG's pixels, the same seed.
    assert decode(webp.data[0].b64_json).tobytes() == decode(png.data[0].b64_json).tobytes()
    with pytest.raises(openai.BadRequestError) as refused:
        c.images.generate(model="tiny-image", prompt="a fox", background="transparent")
    assert refused.value.body["param"] == "background"  # type: ignore[index]


def test_same_seed_same_image_other_seed_other_image(served: Served) -> None:
    c = client(served)

    def gen(seed: int) -> str | None:
        return (
            c.images.generate(
                model="tiny-image", prompt="a boat", size="32x32", extra_body={**FAST, "seed": seed}
            )
            .data[0]
            .b64_json
        )

    assert gen(42) == gen(42)
    assert gen(42) != gen(43)


def test_bad_size_is_400_unknown_model_is_404(served: Served) -> None:
    c = client(served)
    with pytest.raises(openai.BadRequestError, match="size"):
        c.images.generate(model="tiny-image", prompt="x", size="65x64")
    with pytest.raises(openai.BadRequestError):
        c.images.generate(model="tiny-image", prompt="", size="64x64")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.images.generate(model="no-such-model", prompt="x", size="64x64")


def test_curl_sees_openai_shaped_errors(served: Served) -> None:
    out = subprocess.run(
        [
            "curl",
            "-s",
            "-w",
            "\n%{http_code}",
            "-H",
            "content-type: application/json",
            "-d",
            '{"model": "tiny-image", "prompt": "x", "size": "big"}',
            f"{served.base_url}/images/generations",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    body, code = out.rsplit("\n", 1)
    assert code == "400"
    assert '"type":"invalid_request_error"' in body
    assert '"param":"size"' in body


def test_both_denoise_replicas_get_work(served: Served) -> None:
    """Concurrent requests spread over both replicas: the router counts what it has
    dispatched, so the least-loaded choice is not left to chance."""
    replicas = ("denoise-0", "denoise-1")
    count = "omnipipe_stage_request_duration_seconds_count"
    before = {w: served.metric(w, count) for w in replicas}

    def one(i: int) -> None:
        client(served).images.generate(
            model="tiny-image", prompt=f"p{i}", size="32x32", extra_body=FAST
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    after = {w: served.metric(w, count) for w in replicas}
    load = {
        w: (
            served.metric(w, "omnipipe_stage_requests_running"),
            served.metric(w, "omnipipe_stage_requests_waiting"),
        )
        for w in replicas
    }
    assert all(after[w] > before[w] for w in replicas), (before, after, load)


def test_worker_metrics_are_labelled(served: Served) -> None:
    text = served.metrics("encode-0")
    for name in (
        "omnipipe_stage_requests_running",
        "omnipipe_stage_requests_waiting",
        "omnipipe_stage_request_duration_seconds_bucket",
        "omnipipe_transfer_bytes_total",
        "omnipipe_transfer_duration_seconds_bucket",
    ):
        assert f"{name}{{" in text, name
    assert 'pipeline="tiny-image"' in text
    assert 'stage="encode"' in text
    assert served.metric("denoise-0", "omnipipe_transfer_bytes_total") > 0


def test_client_disconnect_cancels_downstream(served: Served) -> None:
    slow = {"num_inference_steps": 60}
    quick = client(served, timeout=openai.Timeout(1.0))
    with pytest.raises(openai.APITimeoutError):
        quick.images.generate(model="tiny-image", prompt="slow", size="512x512", extra_body=slow)
    # decode waits for latents; the cancel reaches it at once, long before denoise would finish.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if served.metric("decode-0", "omnipipe_stage_requests_waiting") == 0:
            break
        time.sleep(0.1)
    assert served.metric("decode-0", "omnipipe_stage_requests_waiting") == 0
    # The denoise loop is interrupted between steps too, so its replicas free up.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        running = sum(
            served.metric(w, "omnipipe_stage_requests_running") for w in ("denoise-0", "denoise-1")
        )
        if running == 0:
            break
        time.sleep(0.1)
    assert running == 0


def test_sigterm_drains_in_flight_work(served: Served) -> None:
    c = client(served, timeout=openai.Timeout(60.0))
    results: list[object] = []
    t = threading.Thread(
        target=lambda: results.append(
            c.images.generate(
                model="tiny-image",
                prompt="drain me",
                size="256x256",
                extra_body={"num_inference_steps": 60},
            )
        )
    )
    t.start()
    victim = served.busy_replica(("denoise-0", "denoise-1"))
    os.kill(served.workers[victim][1], signal.SIGTERM)
    t.join(timeout=60)
    assert results, "the in-flight request did not finish while its worker drained"
    deadline = time.monotonic() + 30
    # uvicorn finishes in-flight requests, then re-raises SIGTERM: status 0 or -15.
    exited = (f"{victim} exited with code 0;", f"{victim} exited with code -15;")
    while not any(e in line for line in served.output for e in exited):
        assert time.monotonic() < deadline, "".join(served.output[-25:])
        time.sleep(0.1)
    # Wait for the restarted replica, so later tests see two again.
    url = served.workers[victim][0]
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_killed_worker_gives_an_error_then_the_survivor_serves(served: Served) -> None:
    """Runs last in this module: it kills a denoise replica."""
    c = client(served, timeout=openai.Timeout(60.0))
    errors: list[BaseException] = []
    started = time.monotonic()

    def slow_request() -> None:
        try:
            c.images.generate(
                model="tiny-image",
                prompt="doomed",
                size="1024x1024",
                extra_body={"num_inference_steps": 200},
            )
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=slow_request)
    t.start()
    victim = served.busy_replica(("denoise-0", "denoise-1"))
    os.kill(served.workers[victim][1], signal.SIGKILL)
    t.join(timeout=30)
    assert not t.is_alive(), "the client hung after its worker died"
    assert errors, "the client got no error"
    assert isinstance(errors[0], openai.APIStatusError), errors
    assert errors[0].status_code == 503
    assert time.monotonic() - started < 30
    # The router dropped the dead replica: the next request succeeds on the survivor.
    r = c.images.generate(model="tiny-image", prompt="after", size="32x32", extra_body=FAST)
    assert decode(r.data[0].b64_json).size == (32, 32)
    # omnipipe serve restarts the dead worker, as a Deployment would.
    deadline = time.monotonic() + 60
    while not any(f"{victim} exited with code -9; restarting" in line for line in served.output):
        assert time.monotonic() < deadline, "".join(served.output[-20:])
        time.sleep(0.2)
