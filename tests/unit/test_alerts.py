"""The alerts: promtool checks the rules and runs their unit tests (tests/unit/alerts/),
the rules use only metrics and labels we export, and every alert has a runbook section.
That the chart's PrometheusRule carries exactly the rules promtool tested needs the
Go-built helm: tests/integration/test_chart_alerts.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omnipipe.operator.metrics import OperatorMetrics
from omnipipe.router.metrics import RouterMetrics
from omnipipe.worker.metrics import WorkerMetrics
from tests.harness.alert_rules import CHART, RULES, THRESHOLDS, check_rules, file_rules, promtool

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs/runbooks.md"
PROMTOOL_TESTS = sorted((Path(__file__).parent / "alerts").glob("*.test.yaml"))
# Labels the chart's PodMonitor adds to every series it scrapes; `exported_namespace` is
# the operator's own `namespace` label, renamed by that scrape.
TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance"}
RENAMED = {"exported_namespace"}
METRIC = re.compile(r"\bomnipipe_[a-z0-9_]+")
GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")
MATCHER = re.compile(r"([a-z_]+)\s*(?:=~|!~|!=|=)\s*\"")
QUOTED = re.compile(r'"[^"]*"')
TEMPLATE_LABEL = re.compile(r"\$labels\.([a-z_]+)")


def alerts() -> list[dict[str, Any]]:
    return [r for g in file_rules()["groups"] for r in g["rules"]]


def exported_labels() -> dict[str, set[str]]:
    """Every omnipipe series the code exports, with its labels (histogram samples by
    their own names: _bucket carries le)."""
    worker = WorkerMetrics.create("p", "s")
    router = RouterMetrics.create()
    router.requests.labels("p", "/v1/x", "200").inc()
    router.duration.labels("p", "/v1/x").observe(1)
    router.pending.labels("p", "s").set(0)
    router.video_job_age.labels("p", "queued").set(0)
    operator = OperatorMetrics.create()
    operator.reconciles.labels("create", "success").inc()
    operator.reconcile_errors.labels("E").inc()
    operator.reconcile_seconds.labels("create").observe(1)
    operator.replicas_desired.labels("n", "p", "s").set(0)
    operator.replicas_ready.labels("n", "p", "s").set(0)
    operator.replicas_max.labels("n", "p", "s").set(0)
    operator.fetch_failing.labels("n", "p", "NoSpace").set(1)
    operator.stalled.labels("n", "p", "FetchFailed").set(1)
    operator.scaling_decisions.labels("n", "p", "s", "ScaleUp").inc()
    labels: dict[str, set[str]] = {}
    registries: list[CollectorRegistry] = [worker.registry, router.registry, operator.registry]
    for registry in registries:
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                labels.setdefault(sample.name, set()).update(sample.labels)
    return {name: found for name, found in labels.items() if name.startswith("omnipipe_")}


def test_promtool_checks_the_rules() -> None:
    assert f"SUCCESS: {len(alerts())} rules found" in check_rules(RULES)


def test_promtool_unit_tests_pass() -> None:
    proc = subprocess.run(
        [promtool(), "test", "rules", *map(str, PROMTOOL_TESTS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(PROMTOOL_TESTS), proc.stdout


def test_every_alert_fires_in_a_test_and_stays_silent_in_another() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for path in PROMTOOL_TESTS:
        suite = yaml.safe_load(path.read_text())
        assert suite["rule_files"] == ["../../../charts/omnipipe/files/alerts.yaml"], path
        for case in suite["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check["exp_alerts"] else silent).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert firing == names, names - firing
    assert silent == names, names - silent
    cases = [c["name"] for p in PROMTOOL_TESTS for c in yaml.safe_load(p.read_text())["tests"]]
    assert "a stage scaled to zero on purpose is not an alert" in cases


def test_alerts_use_only_exported_metrics_and_their_labels() -> None:
    exported = exported_labels()
    for rule in alerts():
        expr = rule["expr"]
        metrics = set(METRIC.findall(expr))
        assert metrics, rule["alert"]
        assert metrics <= exported.keys(), (rule["alert"], metrics - exported.keys())
        known = set().union(*(exported[m] for m in metrics)) | TARGET_LABELS | RENAMED
        used = set(MATCHER.findall(expr))
        for group in GROUPING.findall(expr):
            used.update(label.strip() for label in group.split(",") if label.strip())
        # label_replace(v, "dst", "repl", "src", "regex"): the destination and the source.
        for call in re.findall(r"label_replace\(([^)]*)\)", expr):
            dst, _, src = (s.strip('"') for s in QUOTED.findall(call)[:3])
            used.update({dst, src})
        assert used <= known, (rule["alert"], used - known)
        # The labels the alert carries are its grouping's: the annotations name no other.
        outer = set(GROUPING.findall(expr)[0].replace(" ", "").split(","))
        named = set(TEMPLATE_LABEL.findall(" ".join(rule["annotations"].values())))
        assert named <= outer, (rule["alert"], named - outer)


def test_every_alert_is_labelled_and_has_a_runbook_section() -> None:
    headings = {
        line.removeprefix("## ").strip().lower()
        for line in RUNBOOKS.read_text().splitlines()
        if line.startswith("## ")
    }
    names = set()
    for rule in alerts():
        name = rule["alert"]
        names.add(name)
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        notes = rule["annotations"]
        assert "{{ $labels.pipeline }}" in notes["summary"], name
        # The router's counter has no stage label, a model's fetch is every stage's that
        # uses the model, and a video job waits for the pipeline, not one stage.
        if name not in (
            "OmnipipeErrorRatioHigh",
            "OmnipipeWeightsFetchFailing",
            "OmnipipeVideoJobsWaiting",
        ):
            assert "{{ $labels.stage }}" in notes["summary"], name
        assert notes["runbook"] == f"docs/runbooks.md#{name.lower()}", name
        assert name.lower() in headings, f"docs/runbooks.md has no section {name}"
        assert rule["for"], name
    assert {h for h in headings if h.startswith("omnipipe")} == {n.lower() for n in names}


def test_chart_defaults_are_the_tested_thresholds() -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["alerts"]
    assert defaults["enabled"] is False
    for key, default in THRESHOLDS.values():
        assert f"{defaults[key]:g}" == default, key
