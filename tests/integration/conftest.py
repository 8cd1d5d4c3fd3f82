"""A real control plane for the whole integration session, and the operator running as
a subprocess under its own least-privilege ServiceAccount (deploy/operator-rbac.yaml)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnipipe.local.ports import free_port
from tests.e2e.conftest import (
    Served,
    pytest_runtest_makereport,  # noqa: F401  (serve output on failure)
    start_serve,
)
from tests.harness.cluster import Cluster, control_plane, service_account_kubeconfig
from tests.harness.prometheus import Prometheus, prometheus

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


# Package scope: the control plane stops after the tier's last test, within its timeout,
# and is not left running beside the real node and the unit tests.
@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with control_plane(tmp_path_factory.mktemp("k8s"), with_pods=True) as c:
        c.kubectl("apply", "--server-side", "-f", str(REPO / "crds/omnipipelines.omnipipe.io.yaml"))
        c.wait_crd_established("omnipipelines.omnipipe.io")
        c.kubectl("apply", "-f", str(REPO / "deploy/operator-rbac.yaml"))
        yield c


class Operator:
    """`omnipipe operator` as a user would run it, with the operator's ServiceAccount."""

    def __init__(
        self, cluster: Cluster, kubeconfig: Path, log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.cluster, self.kubeconfig, self.log = cluster, kubeconfig, log
        self.extra_env = env or {}
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = self.cluster.env(self.kubeconfig)
        env["OMNIPIPE_OPERATOR_DRIFT_CHECK_SECONDS"] = "3"
        env["OMNIPIPE_OPERATOR_AUTOSCALE_INTERVAL_SECONDS"] = "1"
        env["OMNIPIPE_OPERATOR_METRIC_MAX_AGE_SECONDS"] = "5"
        # A model cache gives up after two attempts, so a test sees both outcomes quickly.
        env["OMNIPIPE_OPERATOR_FETCH_BACKOFF_LIMIT"] = "1"
        env["OMNIPIPE_OPERATOR_METRICS_PORT"] = str(self.metrics_port)
        env["OMNIPIPE_OPERATOR_HEALTH_PORT"] = str(free_port())
        env.update(self.extra_env)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "omnipipe.cli", "operator"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies mid-reconcile."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def errors(self) -> list[str]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        # ERROR lines, and RBAC denials however they are logged.
        return [
            line for line in text.splitlines() if " ERROR " in line or "is forbidden: User" in line
        ]


@contextmanager
def running_operator(cluster: Cluster) -> Iterator[Operator]:
    """The operator under its ServiceAccount for the block; it must log no error."""
    kubeconfig = service_account_kubeconfig(cluster, "omnipipe-system", "omnipipe-operator")
    op = Operator(cluster, kubeconfig, cluster.workdir / "operator.log")
    op.start()
    yield op
    op.stop()
    assert op.errors() == [], "operator logged errors:\n" + "\n".join(op.errors())


@pytest.fixture(scope="package")
def operator(cluster: Cluster) -> Iterator[Operator]:
    with running_operator(cluster) as op:
        yield op


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A real Prometheus for the module's tests to point at their workers."""
    with prometheus(tmp_path_factory.mktemp("prometheus")) as p:
        yield p


def pipeline_yaml(name: str, spec: dict[str, object]) -> str:
    """An OmniPipeline named `name`, as a user writes one."""
    return yaml.safe_dump(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


@contextmanager
def serving(folder: Path, name: str, text: str) -> Iterator[Served]:
    """`omnipipe serve` of the pipeline file `text`, written to folder/<name>.yaml."""
    path = folder / f"{name}.yaml"
    path.write_text(text)
    served = start_serve(path)
    try:
        yield served
    finally:
        served.stop()


_namespaces = iter(range(1, 10_000))


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"t{next(_namespaces)}-{os.getpid()}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


OPERATOR_ACCOUNT = "system:serviceaccount:omnipipe-system:omnipipe-operator"


def operator_can(cluster: Cluster, *args: str) -> bool:
    """`kubectl auth can-i ARGS` as the chart's operator service account."""
    proc = cluster.kubectl("auth", "can-i", *args, f"--as={OPERATOR_ACCOUNT}", check=False)
    return proc.stdout.strip() == "yes"


def get_json(cluster: Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def children(cluster: Cluster, namespace: str, pipeline: str) -> dict[tuple[str, str], Any]:
    items = get_json(
        cluster,
        "deployments,services,configmaps,horizontalpodautoscalers",
        "-n",
        namespace,
        "-l",
        f"omnipipe.io/pipeline={pipeline}",
        "--show-managed-fields",
    )["items"]
    return {(i["kind"], i["metadata"]["name"]): i for i in items}
