"""Writes what examples/gitops/ copies from the project, so a Git repository made from it
needs nothing outside it: the CRD into base/, and argocd/health.yaml (an argocd-cm patch)
carrying the chart's Argo CD health check. `make manifests` runs it; the GitOps tests
check the copies are current."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GITOPS = REPO / "examples/gitops"
HEALTH_LUA = REPO / "charts/omnipipe/health/omnipipe.io_OmniPipeline.lua"
HEALTH_KEY = "resource.customizations.health.omnipipe.io_OmniPipeline"
HEADER = """\
# Merge into Argo CD's argocd-cm (with the argo-cd Helm chart: under configs.cm). Written
# by `make manifests` from charts/omnipipe/health/omnipipe.io_OmniPipeline.lua: edit that.
"""


def health_configmap() -> str:
    script = "".join(
        f"    {line}" if line.strip() else "\n" for line in HEALTH_LUA.read_text().splitlines(True)
    )
    return (
        f"{HEADER}apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: argocd-cm\n"
        f"  namespace: argocd\ndata:\n  {HEALTH_KEY}: |\n{script}"
    )


def main() -> None:
    shutil.copyfile(
        REPO / "crds/omnipipelines.omnipipe.io.yaml", GITOPS / "base/omnipipelines.omnipipe.io.yaml"
    )
    (GITOPS / "argocd/health.yaml").write_text(health_configmap())


if __name__ == "__main__":
    main()
