"""The dashboards' queries run against a live Prometheus as Grafana runs them, through
hack/dashboard-png.py (which also draws them), and the panels no single test environment
can feed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "charts/omnipipe/files/dashboards"
# No video pipeline runs on the real node (the chart's video store is a Redis the node
# lacks): tests/integration/test_video_panels.py checks these on live data instead.
VIDEO_PANELS = ("Video jobs, queued and running", "Oldest video job's age")


def _load_dashboard_png() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboard_png", REPO / "hack/dashboard-png.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


dashboard_png = _load_dashboard_png()
