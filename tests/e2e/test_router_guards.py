"""The router's guards, end to end: API key, body limit (chunked bodies too), errors in
OpenAI's shape, overload and timeout; and the workers' control API, which refuses calls
without the pipeline credential."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

from omnipipe.api.constants import CREDENTIAL_ENV, CREDENTIAL_HEADER
from tests.e2e.conftest import Served, start_serve, write_pipeline

pytestmark = pytest.mark.timeout(300)
KEY = "s3cret-key"
CREDENTIAL = "e2e-pipeline-credential"


@pytest.fixture(scope="module")
def guarded(tmp_module: Path) -> Iterator[Served]:
    manifest = write_pipeline(tmp_module, "guarded", transfer="tcp")
    s = start_serve(
        manifest,
        env={
            "OMNIPIPE_ROUTER_API_KEY": KEY,
            "OMNIPIPE_ROUTER_MAX_BODY_BYTES": "4096",
            "OMNIPIPE_ROUTER_MAX_QUEUE_PER_REPLICA": "1",
            "OMNIPIPE_ROUTER_REQUEST_TIMEOUT_SECONDS": "3",
            CREDENTIAL_ENV: CREDENTIAL,
        },
    )
    yield s
    s.stop()


def test_api_key_is_required(guarded: Served) -> None:
    with (
        openai.OpenAI(base_url=guarded.base_url, api_key="wrong", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.models.list()
    with openai.OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0) as good:
        assert [m.id for m in good.models.list()] == ["guarded"]
        r = good.images.generate(
            model="guarded", prompt="ok", size="32x32", extra_body={"num_inference_steps": 2}
        )
        assert r.data[0].b64_json


def test_health_and_metrics_need_no_key(guarded: Served) -> None:
    root = guarded.base_url.removesuffix("/v1")
    for path in ("/health", "/ready"):
        code = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", root + path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert code == "200", path
    metrics = subprocess.run(
        ["curl", "-s", root + "/metrics"], capture_output=True, text=True, check=True
    ).stdout
    assert "omnipipe_router_requests_total{" in metrics
    assert "omnipipe_router_request_duration_seconds_bucket{" in metrics


def test_oversized_body_is_413(guarded: Served) -> None:
    with (
        openai.OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0) as c,
        pytest.raises(openai.APIStatusError) as err,
    ):
        c.images.generate(model="guarded", prompt="x" * 10_000, size="32x32")
    assert err.value.status_code == 413


def test_chunked_body_over_the_limit_is_413_before_it_ends(guarded: Served) -> None:
    """No Content-Length: the router answers once the limit is passed, without waiting
    for (or buffering) the rest of a body that may never end."""
    url = urlsplit(guarded.base_url)
    assert url.hostname is not None
    with socket.create_connection((url.hostname, url.port or 80), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: router\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 1024
        for _ in range(16):  # 16 KiB against a 4 KiB limit, and the body never ends
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    # The body may be chunk-framed; the JSON object is in it either way.
    error = json.loads(body[body.index(b"{") : body.rindex(b"}") + 1])["error"]
    assert set(error) == {"message", "type", "param", "code"}


def test_unknown_routes_and_wrong_methods_are_openai_shaped(guarded: Served) -> None:
    for method, path, status in (
        ("POST", "/v1/no-such-thing", 404),
        ("GET", "/v1/images/generations", 405),
        ("DELETE", "/v1/models", 405),
    ):
        request = urllib.request.Request(
            guarded.base_url.removesuffix("/v1") + path,
            method=method,
            headers={"Authorization": f"Bearer {KEY}"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == status, path
        body = json.loads(err.value.read())
        assert set(body) == {"error"}
        assert set(body["error"]) == {"message", "type", "param", "code"}


def _control(served: Served, method: str, path: str, credential: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if credential is not None:
        headers[CREDENTIAL_HEADER] = credential
    submit = {"request_id": "x", "params": {}}
    body = json.dumps(submit).encode() if path == "/v1/requests" else None
    request = urllib.request.Request(
        served.workers["decode-0"][0] + path, data=body, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_worker_control_api_refuses_calls_without_the_credential(guarded: Served) -> None:
    calls = (("POST", "/v1/requests"), ("POST", "/v1/requests/x/cancel"), ("POST", "/drain"))
    for method, path in calls:
        assert _control(guarded, method, path, None) == 401, path
        assert _control(guarded, method, path, "wrong") == 401, path
    # With it, a cancel of an unknown request is accepted (and changes nothing).
    assert _control(guarded, "POST", "/v1/requests/x/cancel", CREDENTIAL) == 200
    assert _control(guarded, "GET", "/drain", CREDENTIAL) == 405
    # The router carries it: requests still go through every stage.
    with openai.OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0) as c:
        r = c.images.generate(
            model="guarded", prompt="ok", size="32x32", extra_body={"num_inference_steps": 2}
        )
    assert r.data[0].b64_json


def test_overload_is_429_and_slow_request_is_504(guarded: Served) -> None:
    outcome: list[BaseException] = []

    def slow() -> None:
        with openai.OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0, timeout=30) as c:
            try:
                c.images.generate(
                    model="guarded",
                    prompt="slow",
                    size="1024x1024",
                    extra_body={"num_inference_steps": 200},
                )
            except BaseException as exc:
                outcome.append(exc)

    t = threading.Thread(target=slow)
    started = time.monotonic()
    t.start()
    deadline = time.monotonic() + 10
    while guarded.metric("denoise-0", "omnipipe_stage_requests_running") == 0:
        assert time.monotonic() < deadline, (outcome, "".join(guarded.output[-15:]))
        time.sleep(0.05)
    with (
        openai.OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0) as c,
        pytest.raises(openai.RateLimitError) as err,
    ):
        c.images.generate(model="guarded", prompt="second", size="32x32")
    assert err.value.response.headers.get("retry-after") == "1"
    t.join(timeout=30)
    assert outcome, "the slow request got no error"
    assert isinstance(outcome[0], openai.APIStatusError), outcome
    assert outcome[0].status_code == 504
    assert time.monotonic() - started < 15
