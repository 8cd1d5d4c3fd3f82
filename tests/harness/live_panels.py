"""The dashboards' queries run against a live Prometheus as Grafana runs them, through
hack/dashboard-png.py (which also draws them), and the panels no single test environment
can feed."""

from __future__ import annotations

from pathlib import Path

from tests.harness.hack_modules import hack_module

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "charts/omnipipe/files/dashboards"
# No video pipeline runs on the real node (the chart's video store is a Redis the node
# lacks): tests/integration/test_video_panels.py checks these on live data instead.
VIDEO_PANELS = ("Video jobs, queued and running", "Oldest video job's age")


dashboard_png = hack_module("dashboard_png", "dashboard-png.py")
