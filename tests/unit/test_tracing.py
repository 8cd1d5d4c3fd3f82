"""Request traces: the router's span carries the client's traceparent on to the stages, and
a stage's phases tile its span."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError
from starlette.testclient import TestClient

from omnipipe.api.loading import load_pipeline, pipeline_yaml
from omnipipe.api.spec import Tracing
from omnipipe.api.tracing import make_tracer, traceparent_of
from omnipipe.cli import otlp_endpoint
from omnipipe.local.reload import plan_reload
from omnipipe.router.metrics import RouterMetrics
from omnipipe.router.middleware import GuardMiddleware
from omnipipe.worker import tracing as wt

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@pytest.fixture
def spans() -> Iterator[tuple[trace.Tracer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def _timeline(**offsets_ms: int) -> wt.Timeline:
    base = 1_700_000_000_000_000_000
    timeline = wt.Timeline()
    for point, ms in offsets_ms.items():
        timeline.mark(point, base + ms * 1_000_000)
    return timeline


def test_a_stages_phases_tile_its_span_in_order(
    spans: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans
    timeline = _timeline(
        submitted=0,
        first_input=40,
        inputs=45,
        queued=46,
        started=50,
        engine_done=250,
        handed_off=260,
        done=262,
    )
    wt.record_request(tracer, "denoise", "r1", CLIENT, timeline)
    finished = {s.name: s for s in exporter.get_finished_spans()}
    stage = finished.pop("stage denoise")
    assert list(finished) == ["wait-upstream", "transfer-in", "queue", "engine", "hand-off", "emit"]
    assert stage.parent is not None
    assert f"{stage.parent.span_id:016x}" == CLIENT.split("-")[2]
    assert f"{stage.context.trace_id:032x}" == CLIENT.split("-")[1]
    cursor = stage.start_time
    for span in finished.values():
        assert span.parent is not None
        assert span.parent.span_id == stage.context.span_id
        assert span.start_time is not None
        assert span.end_time is not None
        assert span.start_time >= cursor
        cursor = span.end_time
    assert cursor == stage.end_time
    engine = finished["engine"]
    assert engine.end_time - engine.start_time == 200_000_000  # type: ignore[operator]
    # The phases tile the stage's span: the moment between the inputs and the queue
    # (1 ms) counts in the queue.
    assert finished["queue"].start_time == finished["transfer-in"].end_time
    assert finished["queue"].end_time - finished["queue"].start_time == 5_000_000  # type: ignore[operator]


def test_a_first_stage_has_no_upstream_phases_and_a_failure_is_marked(
    spans: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans
    timeline = _timeline(submitted=0, queued=0, started=3, engine_done=9)
    wt.record_request(tracer, "encode", "r2", CLIENT, timeline, error="stage_error")
    finished = {s.name: s for s in exporter.get_finished_spans()}
    assert set(finished) == {"stage encode", "queue", "engine"}
    # A first stage queues from its submission.
    assert finished["queue"].start_time == finished["stage encode"].start_time
    assert finished["stage encode"].status.status_code is trace.StatusCode.ERROR
    assert finished["stage encode"].attributes["omnipipe.error"] == "stage_error"  # type: ignore[index]


def test_an_unsampled_traceparent_exports_nothing(
    spans: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans  # the SDK's default sampler follows the parent's decision
    wt.record_request(tracer, "vae", "r3", UNSAMPLED, _timeline(submitted=0, done=5))
    assert exporter.get_finished_spans() == ()


def test_the_spec_field_is_off_by_default_and_checked() -> None:
    assert Tracing().endpoint is None
    assert not make_tracer(Tracing(), "omnipipe-router", "p").exporting
    with pytest.raises(ValidationError, match="endpoint"):
        Tracing(endpoint="collector:4318")
    with pytest.raises(ValidationError, match="sample_ratio"):
        Tracing(endpoint="http://c:4318", sample_ratio=1.5)
    assert otlp_endpoint("http://127.0.0.1:4318") == "http://127.0.0.1:4318"
    with pytest.raises(argparse.ArgumentTypeError, match="OTLP/HTTP endpoint"):
        otlp_endpoint("127.0.0.1:4318")


def test_a_stage_with_no_traceparent_records_nothing(
    spans: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    """The router traces nothing (or predates tracing): no orphan trace per stage."""
    tracer, exporter = spans
    for traceparent in ("", "garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"):
        wt.record_request(tracer, "vae", "r4", traceparent, _timeline(submitted=0, done=5))
    assert exporter.get_finished_spans() == ()


def test_inputs_that_arrived_before_the_submission_make_no_wait_upstream(
    spans: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans
    timeline = _timeline(
        first_input=-3,
        submitted=0,
        inputs=2,
        queued=2,
        started=4,
        engine_done=9,
        handed_off=9,
        done=10,
    )
    wt.record_request(tracer, "decode", "r5", CLIENT, timeline)
    names = [s.name for s in exporter.get_finished_spans()]
    assert names == ["transfer-in", "queue", "engine", "emit", "stage decode"]


def _seen_traceparent(tracer: trace.Tracer | None, headers: dict[str, str]) -> str:
    """What the orchestrator would hand the stages, behind the router's middleware."""
    seen: dict[str, str] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["traceparent"] = traceparent_of(trace.get_current_span())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guarded = GuardMiddleware(
        app,
        pipeline="p",
        api_key=None,
        max_body_bytes=1024,
        metrics=RouterMetrics.create(),
        tracer=tracer,
    )
    TestClient(guarded).post("/v1/images/generations", headers=headers)
    return seen["traceparent"]


def test_the_router_passes_a_clients_traceparent_on_untouched_when_not_tracing() -> None:
    assert _seen_traceparent(None, {"traceparent": CLIENT}) == CLIENT
    assert _seen_traceparent(None, {}) == ""
    assert _seen_traceparent(None, {"traceparent": "garbage"}) == ""


def test_the_routers_span_is_the_clients_child_and_the_stages_parent(
    spans: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans
    handed_on = _seen_traceparent(tracer, {"traceparent": CLIENT})
    (router,) = exporter.get_finished_spans()
    assert isinstance(router, ReadableSpan)
    assert router.kind is trace.SpanKind.SERVER
    assert router.parent is not None
    assert f"{router.parent.span_id:016x}" == CLIENT.split("-")[2]
    _, trace_id, span_id, flags = handed_on.split("-")
    assert trace_id == CLIENT.split("-")[1]
    assert span_id == f"{router.context.span_id:016x}"
    assert flags == "01"
    assert router.attributes["http.response.status_code"] == 200  # type: ignore[index]


def test_the_router_traces_no_unauthenticated_or_non_api_call(
    spans: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guarded = GuardMiddleware(
        app,
        pipeline="p",
        api_key="k",
        max_body_bytes=1024,
        metrics=RouterMetrics.create(),
        tracer=tracer,
    )
    client = TestClient(guarded)
    headers = {"traceparent": CLIENT}
    assert client.post("/v1/images/generations", headers=headers).status_code == 401
    client.get("/docs", headers={**headers, "authorization": "Bearer k"})
    assert exporter.get_finished_spans() == ()
    client.post("/v1/images/generations", headers={**headers, "authorization": "Bearer k"})
    assert len(exporter.get_finished_spans()) == 1


def test_the_operators_pipeline_file_carries_tracing_only_when_set(tmp_path: Path) -> None:
    """The ConfigMap the router and workers read: an untraced pipeline's is what it was
    before tracing existed (an operator upgrade rolls no pod), a traced one's round-trips."""
    manifest = tmp_path / "p.yaml"
    manifest.write_text(
        "apiVersion: omnipipe.io/v1alpha1\nkind: OmniPipeline\nmetadata: {name: p}\n"
        "spec: {model: 'tiny://qwen-image', pipeline: qwen-image}\n"
    )
    plain = load_pipeline(manifest)
    assert "tracing" not in pipeline_yaml(plain)
    traced = plain.model_copy(
        update={"tracing": Tracing(endpoint="http://collector:4318", sample_ratio=0.25)}
    )
    resolved = tmp_path / "pipeline.yaml"
    resolved.write_text(pipeline_yaml(traced))
    assert load_pipeline(resolved).tracing == traced.tracing
    resolved.write_text(pipeline_yaml(plain))
    assert load_pipeline(resolved).tracing == Tracing()


def test_a_reload_that_changes_tracing_asks_for_a_restart(tmp_path: Path) -> None:
    manifest = tmp_path / "p.yaml"
    manifest.write_text(
        "apiVersion: omnipipe.io/v1alpha1\nkind: OmniPipeline\nmetadata: {name: p}\n"
        "spec: {model: 'tiny://qwen-image', pipeline: qwen-image}\n"
    )
    old = load_pipeline(manifest)
    new = old.model_copy(update={"tracing": Tracing(endpoint="http://collector:4318")})
    plan = plan_reload(old, new)
    assert plan.refused is not None
    assert "tracing" in plan.refused
    assert "restart `omnipipe serve`" in plan.refused
