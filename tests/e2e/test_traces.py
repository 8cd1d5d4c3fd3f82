"""One request, one trace: `omnipipe serve` exports the router's span and every stage's
spans over OTLP to a real OpenTelemetry Collector, linked by the client's traceparent."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from PIL import Image

from tests.e2e.conftest import Served, start_serve, stop_cleanly, write_pipeline
from tests.harness.otel import Collector, Span, otel_collector

pytestmark = pytest.mark.timeout(300)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PHASES = ("wait-upstream", "transfer-in", "queue", "engine", "hand-off", "emit")


@pytest.fixture(scope="module")
def collector(tmp_module: Path) -> Iterator[Collector]:
    with otel_collector(tmp_module / "otelcol") as c:
        yield c


def _trace(collector: Collector, trace_id: str, stages: tuple[str, ...]) -> list[Span]:
    """The trace's spans, once the router's and every stage's have arrived (each process
    exports its own, in batches; a span's phases end, and are exported, before it)."""
    wanted = {f"stage {s}" for s in stages}

    def top(span: Span) -> bool:
        return span.trace_id == trace_id and (
            span.name in wanted or span.service == "omnipipe-router"
        )

    collector.wait_for_spans(top, timeout=30, count=len(wanted) + 1, what="router and stages")
    return [s for s in collector.spans() if s.trace_id == trace_id]


def _children(spans: list[Span], parent: Span) -> list[Span]:
    return sorted(
        (s for s in spans if s.parent_span_id == parent.span_id), key=lambda s: s.start_ns
    )


def _check_stage(
    spans: list[Span],
    router: Span,
    stage: str,
    phases: set[str],
    optional: frozenset[str] = frozenset(),
) -> Span:
    """The stage's span is the router's child and within it; its phases (all of `phases`,
    any of `optional`) tile it in order with no gap, and add up to it."""
    (span,) = [s for s in spans if s.name == f"stage {stage}"]
    assert span.service == f"omnipipe-{stage}"
    assert span.parent_span_id == router.span_id, (span, router)
    assert router.start_ns <= span.start_ns <= span.end_ns <= router.end_ns
    children = _children(spans, span)
    names = [c.name for c in children]
    assert phases <= set(names) <= phases | optional, (stage, names)
    assert names == [p for p in PHASES if p in names], (stage, names)
    layout = [(c.name, c.start_ns - span.start_ns, c.end_ns - span.start_ns) for c in children]
    cursor = span.start_ns
    for child in children:
        assert child.service == span.service
        assert child.start_ns == cursor, (stage, layout)
        assert child.end_ns >= child.start_ns, (stage, layout)
        cursor = child.end_ns
    assert cursor == span.end_ns, (stage, layout)
    assert sum(c.duration_ns for c in children) == span.duration_ns
    return span


def test_an_image_requests_trace_has_the_router_and_every_stage(
    tmp_module: Path, collector: Collector
) -> None:
    manifest = write_pipeline(tmp_module, "tiny-traced")
    served: Served = start_serve(manifest, args=("--otlp-endpoint", collector.endpoint))
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0) as client:
            r = client.images.generate(
                model="tiny-traced",
                prompt="a lighthouse",
                size="64x64",
                extra_body={"num_inference_steps": 3},
                extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
            )
        assert Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json or ""))).size == (64, 64)
        spans = _trace(collector, TRACE_ID, ("encode", "denoise", "decode"))
    finally:
        stop_cleanly(served)

    (router,) = [s for s in spans if s.service == "omnipipe-router"]
    assert router.name == "POST /v1/images/generations"
    assert router.parent_span_id == CLIENT_SPAN
    assert router.attributes["http.response.status_code"] == 200
    encode = _check_stage(spans, router, "encode", {"queue", "engine", "hand-off", "emit"})
    # An input may arrive before its stage's submission: then it waited for nothing.
    upstream = set(PHASES) - {"wait-upstream"}
    denoise = _check_stage(spans, router, "denoise", upstream, frozenset({"wait-upstream"}))
    decode = _check_stage(spans, router, "decode", upstream, frozenset({"wait-upstream"}))
    # The hand-offs run stage to stage: each stage's inputs arrive after the previous
    # stage's engine has produced them, and the router's span covers the whole chain.
    engine = {s.parent_span_id: s for s in spans if s.name == "engine"}
    transfer_in = {s.parent_span_id: s for s in spans if s.name == "transfer-in"}
    assert engine[encode.span_id].end_ns <= transfer_in[denoise.span_id].end_ns
    assert engine[denoise.span_id].end_ns <= transfer_in[decode.span_id].end_ns
    assert decode.end_ns <= router.end_ns
    chain = sum(
        engine[s.span_id].end_ns - engine[s.span_id].start_ns for s in (encode, denoise, decode)
    )
    assert chain <= router.end_ns - router.start_ns


def test_an_omni_streams_trace_has_every_streaming_stage(
    tmp_module: Path, collector: Collector
) -> None:
    manifest = tmp_module / "tiny-omni-traced.yaml"
    manifest.write_text(
        (Path(__file__).resolve().parents[2] / "examples/tiny-omni.yaml")
        .read_text()
        .replace("name: tiny-omni}", "name: tiny-omni-traced}")
        + f"  tracing: {{endpoint: '{collector.endpoint}'}}\n"
    )
    served = start_serve(manifest, timeout=300)
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0) as client:
            stream = client.chat.completions.create(
                model="tiny-omni-traced",
                messages=[{"role": "user", "content": "hello"}],
                modalities=["text", "audio"],
                audio={"voice": "Ethan", "format": "pcm16"},
                max_tokens=8,
                stream=True,
                # Unheld, the tiny talker's first code is a stop code about 1 time in 30.
                extra_body={"sampling_params_list": {"talker": {"min_tokens": 16}}},
                extra_headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
            )
            kinds = {
                "audio" if getattr(c.delta, "audio", None) else "text"
                for chunk in stream
                for c in chunk.choices
            }
        assert "audio" in kinds
        spans = _trace(collector, trace_id, ("thinker", "talker", "code2wav"))
    finally:
        stop_cleanly(served)
    (router,) = [s for s in spans if s.service == "omnipipe-router"]
    assert router.name == "POST /v1/chat/completions"
    for stage in ("thinker", "talker", "code2wav"):
        span = _check_stage(spans, router, stage, {"queue", "engine", "emit"})
        assert span.attributes["omnipipe.chunks"] > 0


def test_an_untraced_pipeline_exports_nothing(tmp_module: Path, collector: Collector) -> None:
    """Tracing is off unless the pipeline or serve turns it on: neither a client's
    traceparent nor the SDK's environment variables, pointing at a live collector, make
    any process export a span."""
    served = start_serve(
        write_pipeline(tmp_module, "tiny-untraced"),
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_TRACES_EXPORTER": "otlp"},
    )
    trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
    try:
        with openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0) as client:
            client.images.generate(
                model="tiny-untraced",
                prompt="a lighthouse",
                size="64x64",
                extra_body={"num_inference_steps": 2},
                extra_headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
            )
    finally:
        stop_cleanly(served)
    assert [s for s in collector.spans() if s.trace_id == trace_id] == []
