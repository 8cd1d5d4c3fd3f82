"""The Helm chart: lint, schema validation, a security scan, and a real install whose
ServiceAccount then runs the operator and reconciles an example."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from omnipipe.operator.settings import OperatorSettings
from tests.harness.cluster import BIN, Cluster, control_plane, service_account_kubeconfig
from tests.integration.conftest import REPO, Operator, children, get_json, wait_for

pytestmark = pytest.mark.integration
CHART = REPO / "charts/omnipipe"
KUBE_VERSION = "1.34.4"
NAMESPACE = "omnipipe-system"


def helm(*args: str, cluster: Cluster | None = None) -> subprocess.CompletedProcess[str]:
    env = cluster.env() if cluster else None
    proc = subprocess.run(
        [str(BIN / "helm"), *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chart") / "rendered.yaml"
    out.write_text(
        helm(
            "template", "omnipipe", str(CHART), "-n", NAMESPACE, "--kube-version", KUBE_VERSION
        ).stdout
    )
    return out


def test_helm_lint() -> None:
    helm("lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION)


def test_rendered_chart_validates_against_kubernetes_schemas(rendered: Path) -> None:
    tool = Path(sys.executable).with_name("kubernetes-validate")
    proc = subprocess.run(
        [str(tool), "-k", "1.34.0", "--strict", str(rendered)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "passed for resource deployment/omnipipe" in proc.stdout + proc.stderr


def test_values_schema_rejects_bad_values() -> None:
    proc = subprocess.run(
        [
            str(BIN / "helm"),
            "template",
            "x",
            str(CHART),
            "--kube-version",
            KUBE_VERSION,
            "--set",
            "replicaCount=0",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "replicaCount" in proc.stderr


def test_security_scan_has_only_documented_findings(rendered: Path) -> None:
    allow: dict[str, str] = yaml.safe_load((CHART / "checkov-allowlist.yaml").read_text())
    assert all(len(reason) > 40 for reason in allow.values()), "every exception needs a reason"
    checkov = Path(sys.executable).with_name("checkov")
    proc = subprocess.run(
        [
            str(checkov),
            "-f",
            str(rendered),
            "--framework",
            "kubernetes",
            "--compact",
            "--quiet",
            "--skip-download",
            "-o",
            "cli",
            "--skip-check",
            ",".join(allow),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "Failed checks: 0" in proc.stdout


def test_rbac_matches_deploy_manifest(rendered: Path) -> None:
    docs = list(yaml.safe_load_all(rendered.read_text()))
    chart_role = next(d for d in docs if d and d["kind"] == "ClusterRole")
    deploy = [d for d in yaml.safe_load_all((REPO / "deploy/operator-rbac.yaml").read_text())]
    deploy_role = next(d for d in deploy if d["kind"] == "ClusterRole")
    assert chart_role["rules"] == deploy_role["rules"]


def test_dashboards_are_labelled_for_grafana(rendered: Path) -> None:
    maps = [
        d
        for d in yaml.safe_load_all(rendered.read_text())
        if d and d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]
    ]
    assert len(maps) == 2
    assert all(m["metadata"]["labels"]["grafana_dashboard"] == "1" for m in maps)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with control_plane(tmp_path_factory.mktemp("helm-k8s"), with_pods=True) as c:
        helm(
            "install",
            "omnipipe",
            str(CHART),
            "-n",
            NAMESPACE,
            "--create-namespace",
            "--wait",
            "--timeout",
            "120s",
            cluster=c,
        )
        yield c


def test_install_creates_crds_operator_and_peering(installed: Cluster) -> None:
    installed.kubectl("get", "crd", "omnipipelines.omnipipe.io", "clusterkopfpeerings.kopf.dev")
    dep = get_json(installed, "deployment", "omnipipe", "-n", NAMESPACE)
    assert dep["status"]["readyReplicas"] == 2
    installed.kubectl("get", "clusterkopfpeering", "omnipipe")
    notes = helm("status", "omnipipe", "-n", NAMESPACE, cluster=installed).stdout
    # A first try that needs no GPU, and how to reach it.
    assert "kubectl apply -f examples/tiny-text-to-image.yaml" in notes
    assert "kubectl port-forward svc/tiny-image-router 8000:8000" in notes


def test_chart_service_account_is_enough_to_reconcile_and_no_more(installed: Cluster) -> None:
    kubeconfig = service_account_kubeconfig(installed, NAMESPACE, "omnipipe-operator")
    op = Operator(
        installed,
        kubeconfig,
        installed.workdir / "chart-operator.log",
        env={"OMNIPIPE_OPERATOR_PEERING": "omnipipe"},
    )
    op.start()
    try:
        installed.kubectl("create", "namespace", "apps")
        installed.kubectl("apply", "-n", "apps", "-f", str(REPO / "examples/qwen-image.yaml"))
        installed.kubectl(
            "wait",
            "-n",
            "apps",
            "omnip/qwen-image",
            "--for=condition=Ready",
            "--timeout=90s",
            timeout=100,
        )
        assert len(children(installed, "apps", "qwen-image")) == 9
    finally:
        op.stop()
    assert op.errors() == [], "\n".join(op.errors())
    sa = f"system:serviceaccount:{NAMESPACE}:omnipipe-operator"
    denied = installed.kubectl("get", "secrets", "-A", f"--as={sa}", check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr
    wait_for("the peering record", lambda: get_json(installed, "clusterkopfpeering", "omnipipe"))


def _operator_env(*values: str) -> dict[str, str]:
    sets = [arg for v in values for arg in ("--set-json", v)]
    text = helm(
        "template", "omnipipe", str(CHART), "-n", NAMESPACE, "--kube-version", KUBE_VERSION, *sets
    ).stdout
    dep = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "Deployment")
    [container] = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_stage_network_policy_toggle_and_scrapers_reach_the_operator() -> None:
    env = _operator_env()
    assert env["OMNIPIPE_OPERATOR_STAGE_NETWORK_POLICY"] == "true"
    # The chart's default scrapers are the operator's own default.
    assert json.loads(env["OMNIPIPE_OPERATOR_METRICS_SCRAPE_FROM"]) == (
        OperatorSettings().metrics_scrape_from
    )
    scrapers = [{"namespaceSelector": {"matchLabels": {"team": "observability"}}}]
    env = _operator_env(
        "operator.stageNetworkPolicy.enabled=false",
        f"operator.stageNetworkPolicy.metricsScrapeFrom={json.dumps(scrapers)}",
    )
    assert env["OMNIPIPE_OPERATOR_STAGE_NETWORK_POLICY"] == "false"
    assert json.loads(env["OMNIPIPE_OPERATOR_METRICS_SCRAPE_FROM"]) == scrapers
