"""The chart's PrometheusRule carries exactly the rules promtool tested
(tests/unit/test_alerts.py), with thresholds, labels and the runbook URL from values.
Here rather than in the unit tier because it runs the Go-built helm, which `make test`
builds while the unit tier runs."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.alert_rules import CHART, THRESHOLDS, check_rules, file_rules
from tests.harness.cluster import BIN, K8S_VERSION

pytestmark = pytest.mark.integration
HELM = BIN / "helm"


def helm_template(*args: str) -> list[dict[str, Any]]:
    if not HELM.exists():
        pytest.skip(f"helm not built at {HELM}: make k8s-binaries (hack/build-k8s.sh)")
    # A helm built with `go install` assumes Kubernetes 1.20 without --kube-version.
    command = [str(HELM), "template", "omnipipe", str(CHART), "-n", "omnipipe-system"]
    proc = subprocess.run(
        [*command, "--kube-version", K8S_VERSION.lstrip("v"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def prometheus_rules(*args: str) -> list[dict[str, Any]]:
    return [d for d in helm_template(*args) if d["kind"] == "PrometheusRule"]


def test_alerts_are_off_by_default() -> None:
    assert prometheus_rules() == []


def test_chart_carries_exactly_the_tested_rules(tmp_path: Path) -> None:
    (rule,) = prometheus_rules("--set", "alerts.enabled=true")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "omnipipe-system"
    assert rule["spec"] == file_rules(), "templates/prometheusrule.yaml drifted from the file"
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    check_rules(rendered)


def test_chart_takes_thresholds_labels_and_runbook_url_from_values(tmp_path: Path) -> None:
    thresholds = {
        "engineStallSeconds": 600,
        "queueWaitObjectiveSeconds": 2.5,
        "firstAudioObjectiveSeconds": 0.75,
        "errorRatio": 0.2,
        "videoJobWaitSeconds": 900,
    }
    base = "https://example.com/omnipipe/docs/runbooks.md"
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "alerts": {
                    "enabled": True,
                    "labels": {"release": "prom"},
                    "runbookBaseUrl": base,
                    **thresholds,
                }
            }
        )
    )
    (rule,) = prometheus_rules("-f", str(values))
    assert rule["metadata"]["labels"]["release"] == "prom"
    expected = file_rules()
    for group in expected["groups"]:
        for alert in group["rules"]:
            name = alert["alert"]
            alert["annotations"]["runbook_url"] = f"{base}#{name.lower()}"
            if name in THRESHOLDS:
                key, default = THRESHOLDS[name]
                literal = f"> {default}\n"
                assert alert["expr"].count(literal) == 1, (name, literal)
                alert["expr"] = alert["expr"].replace(literal, f"> {thresholds[key]:g}\n")
    assert rule["spec"] == expected
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    check_rules(rendered)
