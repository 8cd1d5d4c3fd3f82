"""A real OpenTelemetry Collector that receives OTLP, and the spans it received.

hack/build-otel-collector.sh (`make otel-collector`) builds the collector from its own Go
modules (tools/otel/collector: the core otlpreceiver and the contrib fileexporter) and
caches it under ~/.cache/omnipipe/otel/<pinned versions>/bin. This module only runs it: a
missing or stale binary is an error that names `make otel-collector`.

    with otel_collector(tmp_path) as collector:
        exporter = OTLPSpanExporter(endpoint=f"{collector.endpoint}/v1/traces")
        ...
        spans = collector.wait_for_spans(lambda s: s.name == "router", timeout=10)

The collector writes each batch it receives as one line of OTLP JSON (the file exporter's
`format: json`, ptrace.JSONMarshaler); `Collector.spans()` reads the lines back.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnipipe.local.ports import free_port
from tests.harness.gotools import cached_binary, source_digest

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "hack/build-otel-collector.sh"
SOURCES = REPO / "tools/otel"
MODULE_DIR = SOURCES / "collector"
BINARY = "otelcol"
COLLECTOR_MODULE = "go.opentelemetry.io/collector/otelcol"
CONTRIB_MODULE = "github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter"

# OTLP's enums as numbers in its JSON encoding, by the names the Python SDK gives them.
SPAN_KINDS = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
STATUS_CODES = ("UNSET", "OK", "ERROR")


def _pinned(module: str) -> str:
    """The version tools/otel/collector/go.mod pins for module, as the build script reads it."""
    found = re.search(
        rf"^\s*(?:require\s+)?{re.escape(module)}\s+(\S+)",
        (MODULE_DIR / "go.mod").read_text(),
        re.M,
    )
    if found is None:
        raise RuntimeError(f"{MODULE_DIR / 'go.mod'} pins no {module}")
    return found.group(1)


def bin_dir() -> Path:
    cache = Path(os.environ.get("OMNIPIPE_OTEL_CACHE", Path.home() / ".cache/omnipipe/otel"))
    versions = f"otelcol-{_pinned(COLLECTOR_MODULE)}_contrib-{_pinned(CONTRIB_MODULE)}"
    return cache / versions / "bin"


def collector_path() -> Path:
    """The built collector, checked against tools/otel/collector's *.go, go.mod and go.sum;
    never builds it."""
    sources = [
        p
        for p in MODULE_DIR.iterdir()
        if p.is_file() and (p.suffix == ".go" or p.name in ("go.mod", "go.sum"))
    ]
    stamp = source_digest(SOURCES, sources)
    return cached_binary(
        bin_dir() / BINARY, stamp, "tools/otel/collector", "otel-collector", BUILD_SCRIPT
    )


@dataclass(frozen=True)
class Span:
    """One span as the collector received it. Ids are lower-case hex; parent_span_id is ""
    for a root span. Times are Unix nanoseconds."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    service: str  # the resource's service.name, "" when it has none
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status_code: str = "UNSET"  # UNSET, OK or ERROR
    status_message: str = ""
    kind: str = "INTERNAL"  # INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER or UNSPECIFIED
    scope: str = ""  # the instrumentation scope's name (the tracer's)
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def _any_value(value: dict[str, Any]) -> Any:
    """An OTLP AnyValue in its JSON encoding, as the Python value the SDK was given."""
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])  # int64 is a JSON string in OTLP JSON
    if "doubleValue" in value:
        return float(value["doubleValue"])  # also "NaN", "Infinity", "-Infinity"
    if "arrayValue" in value:
        return [_any_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return _attributes(value["kvlistValue"].get("values", []))
    if "bytesValue" in value:
        return base64.b64decode(value["bytesValue"])
    return None


def _attributes(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: _any_value(kv.get("value", {})) for kv in pairs}


def parse_traces(line: str) -> list[Span]:
    """The spans of one ExportTraceServiceRequest in OTLP JSON."""
    spans = []
    for resource_spans in json.loads(line).get("resourceSpans", []):
        resource = _attributes(resource_spans.get("resource", {}).get("attributes", []))
        for scope_spans in resource_spans.get("scopeSpans", []):
            scope = scope_spans.get("scope", {}).get("name", "")
            for s in scope_spans.get("spans", []):
                status = s.get("status", {})
                spans.append(
                    Span(
                        trace_id=s.get("traceId", ""),
                        span_id=s.get("spanId", ""),
                        parent_span_id=s.get("parentSpanId", ""),
                        name=s.get("name", ""),
                        service=str(resource.get("service.name", "")),
                        start_ns=int(s.get("startTimeUnixNano", 0)),
                        end_ns=int(s.get("endTimeUnixNano", 0)),
                        attributes=_attributes(s.get("attributes", [])),
                        status_code=STATUS_CODES[int(status.get("code", 0))],
                        status_message=status.get("message", ""),
                        kind=SPAN_KINDS[int(s.get("kind", 0))],
                        scope=scope,
                        resource=resource,
                    )
                )
    return spans


@dataclass
class Collector:
    """A running collector. endpoint is the base URL an OTLP/HTTP exporter is given (the
    SDK's OTEL_EXPORTER_OTLP_ENDPOINT: it appends /v1/traces itself; a span exporter built
    in code wants f"{endpoint}/v1/traces"); grpc_endpoint is host:port for OTLP/gRPC."""

    endpoint: str
    grpc_endpoint: str
    spans_file: Path
    log_path: Path
    proc: subprocess.Popen[bytes]

    def spans(self) -> list[Span]:
        """Every span received so far, in the order the collector wrote them. A batch is
        on file within the exporter's flush interval (100 ms) of its arrival."""
        try:
            data = self.spans_file.read_bytes()
        except FileNotFoundError:
            return []
        # The exporter writes whole lines, but a read can land between two flushes: decode
        # only up to the last newline, never half a line or half a character.
        complete = data[: data.rfind(b"\n") + 1].decode()
        return [span for line in complete.splitlines() if line for span in parse_traces(line)]

    def wait_for_spans(
        self,
        predicate: Callable[[Span], bool],
        timeout: float = 10.0,
        *,
        count: int = 1,
        what: str = "",
    ) -> list[Span]:
        """The received spans that satisfy predicate, once there are at least count of
        them; AssertionError after timeout seconds, naming what (a description of the
        predicate) and listing what did arrive."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            matched = [s for s in spans if predicate(s)]
            if len(matched) >= count:
                return matched
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the collector exited {self.proc.returncode} while waiting for spans:\n"
                    f"{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"{len(matched)} of {count} span(s) {what or 'matching the predicate'} "
                    f"reached the collector in {timeout:g} s; it received "
                    f"{self.describe(spans)}\ncollector log:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    @staticmethod
    def describe(spans: list[Span], limit: int = 20) -> str:
        if not spans:
            return "no spans"
        lines = [
            f"  {s.service}/{s.name} trace={s.trace_id} span={s.span_id} "
            f"parent={s.parent_span_id or '-'}"
            for s in spans[:limit]
        ]
        more = f"\n  ... and {len(spans) - limit} more" if len(spans) > limit else ""
        return f"{len(spans)} span(s):\n" + "\n".join(lines) + more

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM: the collector stops its receivers, and the exporter flushes and closes
        the file. Killed if it takes longer than timeout."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def _config(http_port: int, grpc_port: int, spans_file: Path) -> str:
    # JSON is YAML: no hand-quoting of paths.
    config = {
        "receivers": {
            "otlp": {
                "protocols": {
                    "http": {"endpoint": f"127.0.0.1:{http_port}"},
                    "grpc": {"endpoint": f"127.0.0.1:{grpc_port}"},
                }
            }
        },
        "exporters": {
            "file": {"path": str(spans_file), "format": "json", "flush_interval": "100ms"}
        },
        "service": {
            # Internal metrics would serve on :8888 by default, which two collectors share.
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
            "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}},
        },
    }
    return json.dumps(config, indent=2)


def _answers(url: str) -> bool:
    """Whether the OTLP/HTTP receiver is serving: it answers a GET on /v1/traces with 405
    (it takes POST only), without a batch entering the pipeline."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=1):
            return True
    except urllib.error.HTTPError as e:
        return e.code == 405
    except OSError:
        return False


@contextlib.contextmanager
def otel_collector(workdir: Path, *, start_timeout: float = 30.0) -> Iterator[Collector]:
    """The collector on free loopback ports, its config, spans file and log in workdir;
    yields once its OTLP/HTTP endpoint answers, and stops it (flushing the file) on exit."""
    binary = collector_path()
    workdir.mkdir(parents=True, exist_ok=True)
    http_port = free_port()
    grpc_port = free_port(avoid=(http_port,))
    spans_file = workdir / "spans.jsonl"
    config = workdir / "otelcol.yaml"
    config.write_text(_config(http_port, grpc_port, spans_file))
    log_path = workdir / "otelcol.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(binary), f"--config={config}"], stdout=log, stderr=subprocess.STDOUT
        )
    collector = Collector(
        endpoint=f"http://127.0.0.1:{http_port}",
        grpc_endpoint=f"127.0.0.1:{grpc_port}",
        spans_file=spans_file,
        log_path=log_path,
        proc=proc,
    )
    try:
        deadline = time.monotonic() + start_timeout
        while not _answers(f"{collector.endpoint}/v1/traces"):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the collector exited {proc.returncode} at start:\n{collector.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"the collector's {collector.endpoint} did not answer in {start_timeout:g} s:"
                    f"\n{collector.log_tail()}"
                )
            time.sleep(0.05)
        yield collector
    finally:
        collector.stop()
