"""The Grafana dashboards: valid, templated, and built only on metrics we export."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from omnipipe.operator.metrics import OperatorMetrics
from omnipipe.router.metrics import RouterMetrics
from omnipipe.worker.metrics import WorkerMetrics

DASHBOARDS = sorted(
    (Path(__file__).resolve().parents[2] / "charts/omnipipe/files/dashboards").glob("*.json")
)
METRIC = re.compile(r"\bomnipipe_[a-z0-9_]+|\bvllm:[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# The operator's reconciles are its own, not a pipeline's: they carry no `namespace` label
# of their own, only the scrape's (the operator's namespace), so a filter on the pipelines'
# $namespace empties them (tests/realnode/test_telemetry.py saw it on live data).
OPERATOR_WIDE = {
    "omnipipe_operator_reconcile_total",
    "omnipipe_operator_reconcile_errors_total",
    "omnipipe_operator_reconcile_duration_seconds_bucket",
}


def _exported(registry: CollectorRegistry) -> set[str]:
    names = set()
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "histogram":
                names.update(name + s for s in HISTOGRAM_SUFFIXES)
    return names


def vllm_metric_names() -> set[str]:
    """What the installed vLLM registers (its v1 stat logger's source, read without
    starting an engine), as Prometheus exposes it: a counter with _total, a histogram
    with its series. The worker re-exports them with its labels (EngineMetrics)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed (make test installs it): its metric names unknown")
    source = (Path(spec.origin).parent / "v1/metrics/loggers.py").read_text()
    names = set(re.findall(r'"(vllm:[a-z0-9_]+)"', source))
    assert "vllm:kv_cache_usage_perc" in names  # the autoscaler's kv-cache signal
    suffixes = ("", "_total", *HISTOGRAM_SUFFIXES)
    return {name + suffix for name in names for suffix in suffixes}


def exported_metric_names() -> set[str]:
    return (
        _exported(WorkerMetrics.create("p", "s").registry)
        | _exported(RouterMetrics.create().registry)
        | _exported(OperatorMetrics.create().registry)
        | vllm_metric_names()
    )


def test_there_are_two_dashboards() -> None:
    assert [p.stem for p in DASHBOARDS] == ["operator", "pipeline-overview"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_valid_and_uses_only_exported_metrics(path: Path) -> None:
    board = json.loads(path.read_text())
    assert board["uid"]
    assert board["title"]
    assert board["schemaVersion"] >= 30
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "namespace"} <= variables
    if path.stem == "pipeline-overview":
        assert "pipeline" in variables
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    exported = exported_metric_names()
    used: set[str] = set()
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(METRIC.findall(target["expr"]))
            used.update(names)
            if names <= OPERATOR_WIDE:
                assert "namespace" not in target["expr"], (panel["title"], target["expr"])
            else:
                assert "$namespace" in target["expr"], (panel["title"], target["expr"])
    assert used, "no omnipipe metric in the dashboard"
    assert used - exported == set(), f"dashboard uses metrics nobody exports: {used - exported}"


def test_operator_dashboard_shows_reconciles_errors_and_scaling() -> None:
    text = DASHBOARDS[0].read_text()
    for metric in (
        "omnipipe_operator_reconcile_total",
        "omnipipe_operator_reconcile_errors_total",
        "omnipipe_operator_scaling_decisions_total",
    ):
        assert metric in text, metric


def test_overview_covers_what_operators_need() -> None:
    board = json.loads((DASHBOARDS[1]).read_text())
    text = json.dumps(board)
    for metric in (
        "omnipipe_router_requests_total",
        "omnipipe_router_request_duration_seconds_bucket",
        "omnipipe_stage_request_duration_seconds_bucket",
        "omnipipe_stage_requests_waiting",
        "omnipipe_stage_replicas_desired",
        "omnipipe_stage_replicas_ready",
        "omnipipe_transfer_bytes_total",
        "omnipipe_transfer_duration_seconds_bucket",
        "omnipipe_stage_time_to_first_audio_seconds_bucket",
        "omnipipe_stage_denoise_steps_total",
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens_total",
        "omnipipe_router_video_jobs",
        "omnipipe_router_video_oldest_job_seconds",
    ):
        assert metric in text, metric
