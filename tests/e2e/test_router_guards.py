"""The router's guards, end to end: API key, body limit, overload and timeout."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import Served, start_serve, write_pipeline

pytestmark = pytest.mark.timeout(300)
KEY = "s3cret-key"


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


def test_overload_is_429_and_slow_request_is_504(guarded: Served) -> None:
    outcome: list[BaseException] = []

    def slow() -> None:
        with openai.OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0, timeout=30) as c:
            try:
                c.images.generate(
                    model="guarded",
                    prompt="slow",
                    size="512x512",
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
