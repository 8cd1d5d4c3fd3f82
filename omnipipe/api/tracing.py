"""Request traces: the tracer the router and the workers make from spec.tracing, and the
W3C traceparent that links a stage's spans to the router's.

No global tracer provider: each app owns its tracer (the FastAPI apps are built by
factories), and one that exports nothing is a no-op tracer, which still carries a
client's traceparent on to the stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from omnipipe.api.spec import Tracing

TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
# One export's longest wait on the collector, and the longest a process's exit waits to
# flush: well inside the pods' termination grace.
EXPORT_SECONDS = 5.0
CLOSE_SECONDS = 5.0


@dataclass
class Tracer:
    """A tracer and what flushes it: `close()` exports the spans still buffered."""

    tracer: trace.Tracer
    provider: TracerProvider | None = None

    @property
    def exporting(self) -> bool:
        return self.provider is not None

    def close(self) -> None:
        """Exports what is buffered, for at most CLOSE_SECONDS: a collector that is down
        must not hold a pod's shutdown (its spans are then lost)."""
        if self.provider is not None:
            self.provider.force_flush(timeout_millis=int(CLOSE_SECONDS * 1000))
            self.provider.shutdown()


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base URL's traces path, as OTEL_EXPORTER_OTLP_ENDPOINT is read."""
    return endpoint.rstrip("/") + "/v1/traces"


def make_tracer(tracing: Tracing, service: str, pipeline: str, stage: str = "") -> Tracer:
    """The tracer for one process of a pipeline: a no-op one unless tracing.endpoint is
    set. The exporter is imported only then: most processes never trace."""
    if tracing.endpoint is None:
        return Tracer(trace.NoOpTracer())
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    attributes = {"service.name": service, "service.namespace": pipeline}
    if stage:
        attributes["omnipipe.stage"] = stage
    provider = TracerProvider(
        resource=Resource.create(attributes),
        sampler=ParentBased(TraceIdRatioBased(tracing.sample_ratio)),
    )
    exporter = OTLPSpanExporter(endpoint=traces_url(tracing.endpoint), timeout=EXPORT_SECONDS)
    provider.add_span_processor(
        BatchSpanProcessor(exporter, export_timeout_millis=EXPORT_SECONDS * 1000)
    )
    return Tracer(provider.get_tracer("omnipipe"), provider)


def parent_context(traceparent: str | None) -> Context:
    """The context a traceparent header names; an empty one when it is missing or
    malformed (the span then starts a new trace)."""
    if not traceparent:
        return Context()
    return _PROPAGATOR.extract({TRACEPARENT: traceparent})


def traceparent_of(span: trace.Span) -> str:
    """The traceparent that makes a span the parent of another process's spans; empty
    for an invalid span (no trace to continue)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def is_valid(traceparent: str) -> bool:
    """A traceparent that names a span to continue."""
    return trace.get_current_span(parent_context(traceparent)).get_span_context().is_valid


def header(headers: Mapping[bytes, bytes]) -> str:
    """The traceparent of raw ASGI headers (already lower-cased)."""
    return headers.get(TRACEPARENT.encode(), b"").decode("latin-1")
