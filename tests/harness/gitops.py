"""What GitOps tools say of an object's health, from their own libraries: Flux's kstatus
(sigs.k8s.io/cli-utils) and Argo CD's Lua health check runtime (argo-cd/v3 util/lua, via
gitops-engine) running the chart's health check, charts/omnipipe/health/.

hack/build-gitops-tools.sh (`make gitops-tools`) builds both programs from tools/gitops/
and caches them under ~/.cache/omnipipe/gitops/<pinned versions>/bin. This module only
runs them: a missing or stale binary is an error that names `make gitops-tools`.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.harness.gotools import cached_binary, go_sources, pinned_default, source_digest

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "hack/build-gitops-tools.sh"
SOURCES = REPO / "tools/gitops"
HEALTH_LUA = REPO / "charts/omnipipe/health/omnipipe.io_OmniPipeline.lua"
# The argocd-cm key that installs HEALTH_LUA, less `resource.customizations.health.`.
ARGOCD_KEY = "omnipipe.io_OmniPipeline"


def bin_dir() -> Path:
    cache = Path(os.environ.get("OMNIPIPE_GITOPS_CACHE", Path.home() / ".cache/omnipipe/gitops"))
    versions = (
        f"cli-utils-{pinned_default(BUILD_SCRIPT, 'CLI_UTILS_VERSION')}"
        f"_argo-cd-{pinned_default(BUILD_SCRIPT, 'ARGOCD_VERSION')}"
    )
    return cache / versions / "bin"


def tool_path(tool: str) -> Path:
    """The built program, checked against tools/gitops/<tool>/*.go; never builds it."""
    stamp = source_digest(SOURCES, go_sources(SOURCES / tool))
    return cached_binary(
        bin_dir() / tool, stamp, f"tools/gitops/{tool}", "gitops-tools", BUILD_SCRIPT
    )


class ToolFailed(RuntimeError):
    """The program exited non-zero: for argocd-health, 1 when the script fails and 3 when
    it returns no status or one that is not Argo CD's."""

    def __init__(self, tool: str, returncode: int, stdout: str, stderr: str) -> None:
        super().__init__(f"{tool} exited {returncode}: {stderr.strip()} {stdout.strip()}")
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _verdict(tool: str, args: Sequence[str], obj: Mapping[str, Any]) -> tuple[str, str]:
    proc = subprocess.run(
        [str(tool_path(tool)), *args],
        input=json.dumps(obj),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if proc.returncode != 0:
        raise ToolFailed(tool, proc.returncode, proc.stdout, proc.stderr)
    out = json.loads(proc.stdout)
    return str(out["status"]), str(out["message"])


def kstatus(obj: Mapping[str, Any]) -> tuple[str, str]:
    """Flux's verdict (kstatus): InProgress, Current, Failed, Terminating, NotFound or
    Unknown, and its message."""
    return _verdict("kstatus", [], obj)


def argo_health(
    obj: Mapping[str, Any], *, script: Path | None = HEALTH_LUA, key: str = ARGOCD_KEY
) -> tuple[str, str]:
    """Argo CD's health of obj with `script` installed under argocd-cm's
    `resource.customizations.health.<key>`: Healthy, Progressing, Degraded, Suspended,
    Missing or Unknown, and its message. With script=None only Argo CD's built-in checks
    apply, and an object they do not know gets no health: status ""."""
    args = [] if script is None else ["--script", str(script), "--key", key]
    return _verdict("argocd-health", args, obj)
