"""schemathesis against the router's own OpenAPI document, on a running tiny pipeline:
whatever it sends (valid by the schema, or just off it), the router never answers 5xx,
and every error is in OpenAI's shape. Every `model` it sends is the served one, so its
requests reach the stages (a free string would be a 404 at the router's first check),
and hypothesis' health checks stay on. The example budget is fixed, so the run is bounded
and repeatable (derandomized)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import settings

from tests.e2e.conftest import Served, start_serve, stop_cleanly, write_pipeline

pytestmark = pytest.mark.timeout(600)
EXAMPLES_PER_OPERATION = 60


OMNI = """apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: fuzzed-omni}
spec:
  model: tiny://qwen2.5-omni
  pipeline: qwen2.5-omni
  transfer: {backend: tcp}
  stages:
    - {name: thinker, sampling: {maxTokens: 8}}
    - {name: talker, sampling: {maxTokens: 30}}
"""
# The route whose 200s show the fuzzer reached the stages, by the pipeline fuzzed.
MAKES = {"image": "/v1/images/generations", "omni": "/v1/chat/completions"}


@pytest.fixture(scope="module", params=list(MAKES))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def served(kind: str, tmp_module: Path) -> Iterator[Served]:
    if kind == "image":
        manifest = write_pipeline(tmp_module, "fuzzed", transfer="tcp")
    else:
        manifest = tmp_module / "fuzzed-omni.yaml"
        manifest.write_text(OMNI)
    s = start_serve(manifest)
    yield s
    stop_cleanly(s)


# What a fuzzed request may ask the stages for: a tiny image in a step or two, a few
# tokens. Left to the defaults (1024x1024, 50 steps) each image that reaches the stages
# takes 20 s here; the router's own bounds on these fields are checked in
# tests/unit/test_router_edges.py.
SMALL_WORK = {
    "size": {"type": "string", "enum": ["64x64", "32x16"]},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
    "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": 2},
    "n": {"type": "integer", "minimum": 1, "maximum": 2},
}


def pinned_to(doc: Any, model: str) -> Any:
    """The document with every request body's `model` the one id served, and the work it
    asks for small."""
    if isinstance(doc, dict):
        properties = doc.get("properties")
        if isinstance(properties, dict) and "model" in properties:
            properties["model"] = {"type": "string", "enum": [model]}
            for name, small in SMALL_WORK.items():
                if name in properties:
                    properties[name] = small
                    doc["required"] = sorted({*doc.get("required", []), name})
        for value in doc.values():
            pinned_to(value, model)
    elif isinstance(doc, list):
        for value in doc:
            pinned_to(value, model)
    return doc


@pytest.fixture(scope="module")
def root(served: Served) -> str:
    return served.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def api(root: str) -> Any:
    doc = httpx.get(f"{root}/openapi.json", timeout=30).json()
    [served_id] = [m["id"] for m in httpx.get(f"{root}/v1/models", timeout=30).json()["data"]]
    return schemathesis.openapi.from_dict(pinned_to(doc, served_id))


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
@settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None)
def test_router_never_fails_and_errors_are_openai_shaped(case: Any, root: str) -> None:
    response = case.call(base_url=root, timeout=60)
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


def test_the_fuzzed_requests_reach_the_stages(root: str, kind: str) -> None:
    """What the pin is for (this runs after the fuzzing, in the module's order): requests
    the fuzzer sent with the served id were answered with images by the pipeline, not
    refused at the router's model check."""
    metrics = httpx.get(f"{root}/metrics", timeout=30).text
    made = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("omnipipe_router_requests_total{")
        and 'code="200"' in line
        and f'route="{MAKES[kind]}"' in line
    ]
    assert sum(made) > 0, "no fuzzed request was answered: the fuzzer never reached a stage"
