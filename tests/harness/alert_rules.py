"""The chart's alert rules as the unit tier (promtool) and the integration tier (the
rendered PrometheusRule) both read them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts/omnipipe"
RULES = CHART / "files/alerts.yaml"
# The values that set a threshold, each with its default (the literal in RULES' expr).
THRESHOLDS = {
    "OmnipipeEngineStalled": ("engineStallSeconds", "300"),
    "OmnipipeQueueWaitHigh": ("queueWaitObjectiveSeconds", "10"),
    "OmnipipeFirstAudioSlow": ("firstAudioObjectiveSeconds", "2"),
    "OmnipipeErrorRatioHigh": ("errorRatio", "0.05"),
    "OmnipipeVideoJobsWaiting": ("videoJobWaitSeconds", "1800"),
}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found: Debian's prometheus package has it (make system-deps)")
    return path


def file_rules() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(RULES.read_text())
    return loaded


def check_rules(path: Path) -> str:
    proc = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
