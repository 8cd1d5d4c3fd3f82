"""A family from outside omnipipe (tests/plugins/sketch) on the real API server: the CRD
that `omnipipe crd` writes where the family is installed admits its pipeline type, and
the operator, run where the family is installed, builds and readies it as it does its own
families. A pipeline type that the CRD admits but no family of the operator's registers
is Stalled, naming the families the operator has."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.harness.cluster import Cluster, control_plane
from tests.integration.conftest import (
    REPO,
    Operator,
    children,
    get_json,
    running_operator,
    wait_for,
)

pytestmark = pytest.mark.integration
# A type a family that the operator's image lacks would register.
ELSEWHERE = "sketch-video"


def pipeline(name: str, model: str, pipeline_type: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": name},
            "spec": {"model": model, "pipeline": pipeline_type},
        }
    )


def plugin_crd_yaml() -> str:
    """The CRD as `omnipipe crd` writes it with the sketch family installed, and one more
    pipeline type beside it, as an image with yet another family would write it."""
    crd = yaml.safe_load(
        subprocess.run(
            [sys.executable, "-m", "omnipipe.cli", "crd"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    enum = spec["properties"]["pipeline"]["enum"]
    assert "sketch-image" in enum
    enum.insert(enum.index("custom"), ELSEWHERE)
    return yaml.safe_dump(crd)


# A control plane and an operator of this module's own: the changed CRD stays out of the
# session's cluster, whose other tests read the released one.
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with control_plane(tmp_path_factory.mktemp("plugin-k8s"), with_pods=True) as c:
        c.kubectl("apply", "--server-side", "-f", "-", input=plugin_crd_yaml())
        c.wait_crd_established("omnipipelines.omnipipe.io")
        c.kubectl("apply", "-f", str(REPO / "deploy/operator-rbac.yaml"))
        yield c


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[Operator]:
    with running_operator(cluster) as op:
        yield op


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"plugin-{next(_namespaces)}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


_namespaces = itertools.count(1)


def _conditions(cluster: Cluster, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    status = get_json(cluster, "omnip", name, "-n", namespace).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}


def test_the_operator_builds_and_readies_an_outside_familys_pipeline(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=pipeline("sketch", "tiny://sketch-image", "sketch-image"),
    )
    found = wait_for(
        "the sketch family's children",
        lambda: (
            (c := children(cluster, namespace, "sketch"))
            and {n for k, n in c if k == "Service"}
            == {"sketch-router", "sketch-encode", "sketch-denoise", "sketch-decode"}
            and c
        ),
    )
    deployments = sorted(n for k, n in found if k == "Deployment")
    # A stage's Deployment is named for its revision; the router's is not.
    assert [d.rsplit("-", 1)[0] for d in deployments if d != "sketch-router"] == [
        "sketch-decode",
        "sketch-denoise",
        "sketch-encode",
    ]
    assert "sketch-router" in deployments
    cluster.kubectl(
        "wait",
        "-n",
        namespace,
        "omnip/sketch",
        "--for=condition=Ready",
        "--timeout=90s",
        timeout=100,
    )


def test_a_type_no_family_of_the_operators_registers_is_stalled_naming_the_installed(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """A pipeline that served, then names a type the operator lacks (as when the operator
    is rolled back to an image without the family): Stalled, its served status cleared,
    what it built left as it was."""
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=pipeline("moved", "tiny://sketch-image", "sketch-image"),
    )
    cluster.kubectl(
        "wait",
        "-n",
        namespace,
        "omnip/moved",
        "--for=condition=Ready",
        "--timeout=90s",
        timeout=100,
    )
    built = set(children(cluster, namespace, "moved"))
    assert get_json(cluster, "omnip", "moved", "-n", namespace)["status"]["endpoint"]
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=pipeline("moved", "tiny://sketch-image", ELSEWHERE),
    )
    conditions = wait_for(
        "Stalled",
        lambda: (
            (c := _conditions(cluster, namespace, "moved"))
            and c.get("Stalled", {}).get("status") == "True"
            and c
        ),
    )
    stalled = conditions["Stalled"]
    assert stalled["reason"] == "PipelineTypeNotInstalled"
    for family in (
        "qwen-image (qwen-image, qwen-image-edit, qwen-image-edit-plus)",
        "sketch (sketch-image)",
    ):
        assert family in stalled["message"]
    assert f"{ELSEWHERE!r} is not installed" in stalled["message"]
    assert (conditions["Ready"]["status"], conditions["Reconciling"]["status"]) == (
        "False",
        "False",
    )
    status = get_json(cluster, "omnip", "moved", "-n", namespace)["status"]
    assert {k: v for k, v in status.items() if k not in ("conditions", "observedGeneration")} == {
        "stages": [],
        "revisions": [],
    }
    assert set(children(cluster, namespace, "moved")) == built
    # Said once in status, not retried as an error.
    assert operator.errors() == []
