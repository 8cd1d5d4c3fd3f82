"""What Grafana's own code says of a dashboard, without a Grafana server: the Grafana
Foundation SDK's strict decoding and Validate() (tools/grafana/dashcheck), and Grafana's
dashboard-linter.

hack/build-grafana-tools.sh (`make grafana-tools`) builds both programs and caches them
under ~/.cache/omnipipe/grafana/<pinned versions>/bin. This module only runs them: a
missing or stale binary is an error that names `make grafana-tools`.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.harness.gotools import cached_binary, go_sources, pinned_default, source_digest

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "hack/build-grafana-tools.sh"
SOURCES = REPO / "tools/grafana"
DASHBOARDS = REPO / "charts/omnipipe/files/dashboards"


def bin_dir() -> Path:
    cache = Path(os.environ.get("OMNIPIPE_GRAFANA_CACHE", Path.home() / ".cache/omnipipe/grafana"))
    versions = (
        f"sdk-{pinned_default(BUILD_SCRIPT, 'GRAFANA_SDK_VERSION')}"
        f"_dashboard-linter-{pinned_default(BUILD_SCRIPT, 'DASHBOARD_LINTER_VERSION')}"
    )
    return cache / versions / "bin"


def tool_path(tool: str) -> Path:
    """The built program, checked against its stamp; never builds it. dashcheck's stamp is
    the digest of tools/grafana/dashcheck/*.go; dashboard-linter, built unchanged from its
    module, is stamped with its pinned version."""
    if tool == "dashboard-linter":
        stamp = pinned_default(BUILD_SCRIPT, "DASHBOARD_LINTER_VERSION")
    else:
        stamp = source_digest(SOURCES, go_sources(SOURCES / tool))
    return cached_binary(bin_dir() / tool, stamp, f"{tool}'s", "grafana-tools", BUILD_SCRIPT)


@dataclass(frozen=True)
class Verdict:
    returncode: int
    output: str  # stdout and stderr together


def dashcheck(*dashboards: Path) -> Verdict:
    """Strict decoding and Validate() of each dashboard: exit 0 when all pass, 1 when any
    does not; the output has one `FILE: ok` or `FILE: decode|validate: PATH: MESSAGE` line
    per finding."""
    return _run([str(tool_path("dashcheck")), *map(str, dashboards)])


def lint(dashboard: Path, *, config: Path | None = None) -> Verdict:
    """`dashboard-linter lint --strict`: exit 0 when no rule reports a warning or an error.
    Without `config` the linter reads the `.lint` file beside the dashboard, if any."""
    args = [str(tool_path("dashboard-linter")), "lint", "--strict", "--verbose"]
    if config is not None:
        args += ["--config", str(config)]
    return _run([*args, str(dashboard)])


def _run(args: list[str]) -> Verdict:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    return Verdict(proc.returncode, proc.stdout + proc.stderr)
