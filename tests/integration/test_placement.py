"""spec.placement against the real API server and the operator: a colocated group
becomes one Deployment whose kwok pods make each of its stages Ready, its replicas
change in place, and a placement change on a live pipeline is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.harness.cluster import Cluster
from tests.integration.conftest import Operator, get_json, wait_for
from tests.integration.test_operator import apply, ready, revision

REPO = Path(__file__).resolve().parents[2]
GROUPED = REPO / "examples/tiny-image-grouped.yaml"
NAME = "tiny-image-grouped"


def deployments(cluster: Cluster, namespace: str) -> dict[str, Any]:
    items = get_json(cluster, "deployments", "-n", namespace)["items"]
    return {d["metadata"]["name"]: d for d in items}


def test_a_group_runs_as_one_deployment_and_makes_each_stage_ready(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    manifest = yaml.safe_load(GROUPED.read_text())
    rev = revision(manifest)
    apply(cluster, namespace, GROUPED)
    ready(cluster, namespace, NAME)
    assert sorted(deployments(cluster, namespace)) == [
        f"{NAME}-encode-{rev}",
        f"{NAME}-pixels-{rev}",
        f"{NAME}-router",
    ]
    status = get_json(cluster, "omnip", NAME, "-n", namespace)["status"]
    conds = {c["type"]: c["status"] for c in status["conditions"]}
    assert conds["StageDenoiseReady"] == conds["StageDecodeReady"] == "True"
    # Both grouped stages' Services resolve to the group's pod.
    for stage in ("denoise", "decode"):
        endpoints = get_json(
            cluster,
            "endpointslices",
            "-n",
            namespace,
            "-l",
            f"kubernetes.io/service-name={NAME}-{stage}",
        )["items"]
        assert [len(s.get("endpoints") or []) for s in endpoints] == [1], stage

    # A group's replicas change in place; its stages follow.
    manifest["spec"]["placement"]["groups"][0]["replicas"] = 2
    apply(cluster, namespace, manifest)
    wait_for(
        "the group's Deployment at 2 replicas",
        lambda: deployments(cluster, namespace)[f"{NAME}-pixels-{rev}"]["spec"]["replicas"] == 2,
    )

    # Moving stages between processes on a live pipeline is refused, naming the field.
    manifest["spec"]["placement"] = {"mode": "colocated"}
    refused = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=False
    )
    assert refused.returncode != 0
    assert "spec.placement cannot change on a running pipeline" in refused.stderr
