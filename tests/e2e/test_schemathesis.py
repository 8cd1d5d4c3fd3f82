"""schemathesis against the router's own OpenAPI document, on a running tiny pipeline:
whatever it sends (valid by the schema, or just off it), the router never answers 5xx,
and every error is in OpenAI's shape. The example budget is fixed, so the run is bounded
and repeatable (derandomized)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.e2e.conftest import Served, start_serve, stop_cleanly, write_pipeline

pytestmark = pytest.mark.timeout(600)
EXAMPLES_PER_OPERATION = 60


@pytest.fixture(scope="module")
def served(tmp_module: Path) -> Iterator[Served]:
    # A short timeout: a generated request that is valid and slow must not hold the run.
    s = start_serve(write_pipeline(tmp_module, "fuzzed", transfer="tcp"))
    yield s
    stop_cleanly(s)


@pytest.fixture(scope="module")
def api(served: Served) -> Any:
    return schemathesis.openapi.from_url(served.base_url.removesuffix("/v1") + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api")


def assert_openai_shaped(body: Any) -> None:
    assert isinstance(body, dict), body
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str), body
    assert error["message"], body
    assert isinstance(error["type"], str), body


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_router_never_fails_and_errors_are_openai_shaped(case: Any) -> None:
    response = case.call(timeout=60)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400:
        assert_openai_shaped(response.json())


def test_the_document_lists_every_v1_route(api: Any) -> None:
    operations = {(op.ok().method.upper(), op.ok().path) for op in api.get_all_operations()}
    assert {
        ("GET", "/v1/models"),
        ("POST", "/v1/images/generations"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/audio/speech"),
    } <= operations
