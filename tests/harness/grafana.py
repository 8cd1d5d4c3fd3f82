"""What Grafana's own code says of a dashboard, without a Grafana server: the Grafana
Foundation SDK's strict decoding and Validate() (tools/grafana/dashcheck), and Grafana's
dashboard-linter.

hack/build-grafana-tools.sh (`make grafana-tools`) builds both programs and caches them
under ~/.cache/omnipipe/grafana/<pinned versions>/bin. This module only runs them: a
missing or stale binary is an error that names `make grafana-tools`.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "hack/build-grafana-tools.sh"
SOURCES = REPO / "tools/grafana"
DASHBOARDS = REPO / "charts/omnipipe/files/dashboards"


def _pinned(variable: str) -> str:
    """The version the build script pins (its `VAR="${VAR:-vX}"` default), unless the
    environment overrides it, as it does for the script."""
    if variable in os.environ:
        return os.environ[variable]
    found = re.search(
        rf'^{variable}="\$\{{{variable}:-([^}}]+)\}}"$', BUILD_SCRIPT.read_text(), re.M
    )
    if found is None:
        raise RuntimeError(f"{BUILD_SCRIPT} pins no {variable}")
    return found.group(1)


def bin_dir() -> Path:
    cache = Path(os.environ.get("OMNIPIPE_GRAFANA_CACHE", Path.home() / ".cache/omnipipe/grafana"))
    versions = (
        f"sdk-{_pinned('GRAFANA_SDK_VERSION')}"
        f"_dashboard-linter-{_pinned('DASHBOARD_LINTER_VERSION')}"
    )
    return cache / versions / "bin"


def source_digest(tool: str) -> str:
    """The build script's stamp of a tool: for dashcheck, sha256 over each file of
    tools/grafana/dashcheck/*.go, its path relative to tools/grafana, a NUL and its bytes,
    in byte order of the paths; for dashboard-linter, which is built unchanged from its
    module, its pinned version."""
    if tool == "dashboard-linter":
        return _pinned("DASHBOARD_LINTER_VERSION")
    digest = hashlib.sha256()
    for rel in sorted(p.relative_to(SOURCES).as_posix() for p in (SOURCES / tool).glob("*.go")):
        digest.update(rel.encode() + b"\0" + (SOURCES / rel).read_bytes())
    return digest.hexdigest()


def tool_path(tool: str) -> Path:
    """The built program, checked against its sources; never builds it."""
    path = bin_dir() / tool
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: run `make grafana-tools` ({BUILD_SCRIPT.name})")
    stamp = path.with_name(f"{tool}.src")
    if not stamp.is_file() or stamp.read_text().strip() != source_digest(tool):
        raise RuntimeError(
            f"{path} was built from other sources than {tool}'s: "
            f"run `make grafana-tools` ({BUILD_SCRIPT.name})"
        )
    return path


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
