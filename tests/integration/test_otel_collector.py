"""The trace tests' collector (tests/harness/otel.py): spans sent by the OpenTelemetry
Python SDK's own OTLP exporters reach the real collector (its otlpreceiver, built from the
collector's Go modules by `make otel-collector`) and read back with their parentage,
names, service, times, attributes and status."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from tests.harness.otel import Collector, collector_path, otel_collector

pytestmark = pytest.mark.integration


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    with otel_collector(tmp_path / "otel") as c:
        yield c


def provider(service: str, exporter: SpanExporter) -> TracerProvider:
    tp = TracerProvider(resource=Resource.create({"service.name": service}))
    tp.add_span_processor(BatchSpanProcessor(exporter))
    return tp


def http_exporter(collector: Collector) -> OTLPSpanExporter:
    return OTLPSpanExporter(endpoint=f"{collector.endpoint}/v1/traces")


def hex_id(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def test_parent_and_child_round_trip(collector: Collector) -> None:
    tp = provider("omnipipe-router", http_exporter(collector))
    tracer = tp.get_tracer("omnipipe.test")
    with (
        tracer.start_as_current_span(
            "POST /v1/images/generations",
            kind=SpanKind.SERVER,
            attributes={"http.route": "/v1/images/generations", "omnipipe.stages": 3},
        ) as parent,
        tracer.start_as_current_span(
            "stage denoise",
            attributes={
                "omnipipe.stage": "denoise",
                "omnipipe.queue_seconds": 0.25,
                "omnipipe.batched": True,
                "omnipipe.replicas": ["denoise-0", "denoise-1"],
            },
        ) as child,
    ):
        child.set_status(Status(StatusCode.ERROR, "engine stalled"))
    assert tp.force_flush(timeout_millis=10_000)
    assert isinstance(parent, ReadableSpan)
    assert isinstance(child, ReadableSpan)
    trace_id = hex_id(parent.get_span_context().trace_id, 32)

    spans = collector.wait_for_spans(lambda s: s.trace_id == trace_id, count=2)
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"POST /v1/images/generations", "stage denoise"}
    root, stage = by_name["POST /v1/images/generations"], by_name["stage denoise"]

    assert root.span_id == hex_id(parent.get_span_context().span_id, 16)
    assert root.parent_span_id == ""
    assert stage.span_id == hex_id(child.get_span_context().span_id, 16)
    assert stage.parent_span_id == root.span_id
    assert stage.trace_id == root.trace_id == trace_id
    assert root.service == stage.service == "omnipipe-router"
    assert root.resource["telemetry.sdk.language"] == "python"
    assert root.scope == "omnipipe.test"
    assert (root.kind, stage.kind) == ("SERVER", "INTERNAL")

    # Times are the SDK's own, to the nanosecond, and the child lies within its parent.
    assert (root.start_ns, root.end_ns) == (parent.start_time, parent.end_time)
    assert (stage.start_ns, stage.end_ns) == (child.start_time, child.end_time)
    assert root.start_ns <= stage.start_ns <= stage.end_ns <= root.end_ns
    assert 0 < stage.duration_ns <= root.duration_ns

    assert root.attributes == {"http.route": "/v1/images/generations", "omnipipe.stages": 3}
    assert stage.attributes == {
        "omnipipe.stage": "denoise",
        "omnipipe.queue_seconds": 0.25,
        "omnipipe.batched": True,
        "omnipipe.replicas": ["denoise-0", "denoise-1"],
    }
    assert (root.status_code, root.status_message) == ("UNSET", "")
    assert (stage.status_code, stage.status_message) == ("ERROR", "engine stalled")
    tp.shutdown()


def test_grpc_endpoint_receives(collector: Collector) -> None:
    tp = provider(
        "omnipipe-worker", GrpcSpanExporter(endpoint=collector.grpc_endpoint, insecure=True)
    )
    with tp.get_tracer("omnipipe.test").start_as_current_span("engine step") as span:
        pass
    assert tp.force_flush(timeout_millis=10_000)
    assert isinstance(span, ReadableSpan)
    [got] = collector.wait_for_spans(lambda s: s.name == "engine step")
    assert got.service == "omnipipe-worker"
    assert got.span_id == hex_id(span.get_span_context().span_id, 16)
    tp.shutdown()


def test_spans_are_on_file_after_the_collector_stops(tmp_path: Path) -> None:
    with otel_collector(tmp_path / "otel") as collector:
        tp = provider("omnipipe-router", http_exporter(collector))
        with tp.get_tracer("omnipipe.test").start_as_current_span("last words"):
            pass
        assert tp.force_flush(timeout_millis=10_000)
        tp.shutdown()
    # Stopped (SIGTERM) right after the export returned: a clean exit, the batch on file.
    assert collector.proc.returncode == 0, collector.log_tail()
    assert [s.name for s in collector.spans()] == ["last words"]


def test_a_span_never_sent_is_not_found(collector: Collector) -> None:
    tp = provider("omnipipe-router", http_exporter(collector))
    with tp.get_tracer("omnipipe.test").start_as_current_span("sent"):
        pass
    assert tp.force_flush(timeout_millis=10_000)
    tp.shutdown()
    collector.wait_for_spans(lambda s: s.name == "sent")

    with pytest.raises(AssertionError) as failed:
        collector.wait_for_spans(
            lambda s: s.name == "never sent", timeout=1.0, what="named 'never sent'"
        )
    message = str(failed.value)
    assert "0 of 1 span(s) named 'never sent' reached the collector in 1 s" in message
    assert "it received 1 span(s):" in message
    assert "omnipipe-router/sent" in message
    assert "Everything is ready" in message  # the collector's log comes with it


def test_missing_collector_names_the_make_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNIPIPE_OTEL_CACHE", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match=r"is missing: run `make otel-collector`"):
        collector_path()
