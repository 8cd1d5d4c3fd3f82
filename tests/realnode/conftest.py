"""The real-node tier: one real single-node cluster for the whole run (tests/harness/node.py),
the Dockerfile's images imported into its containerd, the chart installed with helm so
the operator runs as a pod under its ServiceAccount, and Prometheus scraping the pods by
Kubernetes service discovery. Every step goes through what a user has: helm, kubectl and
the openai client."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.cluster import BIN, REPO
from tests.harness.gitops import argo_health, kstatus
from tests.harness.node import (
    BRIDGE_IP,
    IMAGE_LAYOUTS,
    NSENTER,
    RealNode,
    missing_prerequisite,
    real_node,
)
from tests.harness.prometheus import Prometheus, prometheus

IMAGE_REPO = "localhost/omnipipe"
IMAGE_TAG = "dev"
PROMETHEUS_URL = f"http://{BRIDGE_IP}:9090"
OPERATOR_NAMESPACE = "omnipipe-system"
ALERT_HOLD = "5s"
# tiny://qwen2.5-omni's random talker draws a stop code first about 1 request in 30 (60
# unseeded requests measured: 2 came back text only, as the model chose). Seeded, what a
# request draws is fixed; seed 3 speaks for 1.8 s.
SPEAKING_SEED = 3
# Where a test must hear speech whatever the seed: the talker may not stop before this
# many codes (min_tokens holds its stop codes back), so the reply always has audio.
MUST_SPEAK = {"sampling_params_list": {"talker": {"min_tokens": 16}}}
# Errors a test causes on purpose, each a string its operator log lines contain (a
# ResourceQuota's name, say): the operator fixture's no-error check passes over them.
# (The 429 a CRD's watch cache gives while it starts is logged as a warning:
# omnipipe/operator/logs.py.)
EXPECTED_OPERATOR_ERRORS: list[str] = []


# Package scope, not session: the node goes down right after the tier's last test,
# inside that test's teardown and its timeout (900 s), not after the whole run's last
# test, whose 30 s cut the node's teardown short and left its daemons running.
@pytest.fixture(scope="package")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    reason = missing_prerequisite()
    if reason:
        pytest.skip(f"no real node on this machine: {reason}")
    with real_node(tmp_path_factory.mktemp("node")) as n:
        yield n


@pytest.fixture(scope="package")
def images(node: RealNode) -> dict[str, str]:
    """The operator, router and CPU worker images, built (a no-op when cached, which
    `make test` has done before pytest starts) and imported into the node."""
    proc = subprocess.run(
        ["bash", str(REPO / "hack/node-images.sh")],
        stdout=sys.stderr,
        stderr=subprocess.STDOUT,
        timeout=3600,
        check=False,
    )
    assert proc.returncode == 0, "hack/node-images.sh failed (its output is above)"
    names = {}
    for target in ("operator", "router", "worker"):
        names[target] = f"{IMAGE_REPO}/{target}:{IMAGE_TAG}"
        node.import_image(IMAGE_LAYOUTS / target, names[target])
    return names


@pytest.fixture(scope="package")
def prom(node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Prometheus inside the node's namespace, on the bridge address the operator's pod
    reaches, scraping every omnipipe pod (router, stages and the operator) as the chart's
    PodMonitor selects them: pod role, the pod's namespace and name as labels, and the
    operator's own `namespace` label kept (honorLabels). It evaluates the chart's alerts."""
    local = node.workdir / "local.kubeconfig"
    workdir = tmp_path_factory.mktemp("prometheus")
    scrape = f"""  - job_name: omnipipe-pods
    kubernetes_sd_configs:
      - role: pod
        kubeconfig_file: {local}
    relabel_configs:
      - source_labels: [__meta_kubernetes_pod_label_app_kubernetes_io_name]
        regex: omnipipe
        action: keep
      - source_labels: [__meta_kubernetes_pod_container_port_name]
        regex: control|http
        action: keep
      - source_labels: [__meta_kubernetes_namespace]
        target_label: namespace
      - source_labels: [__meta_kubernetes_pod_name]
        target_label: pod
  # The PodMonitor's `metrics` endpoint: the operator's pod. Its stage gauges and scaling
  # decisions carry the pipeline's namespace in their own `namespace` label, which
  # honor_labels keeps (the target's, omnipipe-system, goes on the series without one).
  - job_name: omnipipe-operator
    honor_labels: true
    kubernetes_sd_configs:
      - role: pod
        kubeconfig_file: {local}
    relabel_configs:
      - source_labels: [__meta_kubernetes_pod_label_app_kubernetes_io_name]
        regex: omnipipe
        action: keep
      - source_labels: [__meta_kubernetes_pod_container_port_name]
        regex: metrics
        action: keep
      - source_labels: [__meta_kubernetes_namespace]
        target_label: namespace
      - source_labels: [__meta_kubernetes_pod_name]
        target_label: pod
"""
    with prometheus(
        workdir,
        scrape_configs=scrape,
        listen=f"{BRIDGE_IP}:9090",
        wrapper=NSENTER,
        # Debian's Prometheus has no Kubernetes service discovery: hack/build-node.sh's.
        binary=str(BIN / "prometheus"),
        rule_files=[shortened_alerts(workdir / "alerts.yaml")],
    ) as p:
        yield p


def shortened_alerts(path: Path) -> Path:
    """The chart's alerts (charts/omnipipe/files/alerts.yaml), every expression as it is,
    each `for:` cut to 5 s: the chart's holds (1 to 30 minutes) would outlast any test,
    and what a test proves live is that the expression fires on what the pods export."""
    rules = yaml.safe_load((REPO / "charts/omnipipe/files/alerts.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = ALERT_HOLD
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def helm(node: RealNode, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run(
        [str(BIN / "helm"), *args],
        env=node.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stderr}{proc.stdout}"
    return proc.stdout


@pytest.fixture(scope="package")
def operator(node: RealNode, images: dict[str, str]) -> Iterator[str]:
    """`helm install` of the chart: the operator runs as a pod under its ServiceAccount,
    from the image built here. Yields the release's namespace."""
    started = time.monotonic()
    helm(
        node,
        "install",
        "omnipipe",
        str(REPO / "charts/omnipipe"),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--set",
        f"image.repository={IMAGE_REPO}/operator",
        "--set",
        f"image.tag={IMAGE_TAG}",
        # Imported, never pulled: the node has no registry to pull from.
        "--set",
        "image.pullPolicy=Never",
        "--set",
        "replicaCount=1",
        "--set",
        f"operator.workerImage={images['worker']}",
        "--set",
        f"operator.routerImage={images['router']}",
        "--set",
        f"operator.prometheusUrl={PROMETHEUS_URL}",
        "--set",
        "operator.autoscaleIntervalSeconds=2",
        "--set",
        "operator.metricMaxAgeSeconds=10",
        "--set",
        "operator.terminationGraceSeconds=30",
        # Stalled sooner than a user's defaults (3 restarts, 60 s), so test_gitops sees
        # each Failed verdict in well under a minute of crash loop or Pending.
        "--set",
        "operator.crashLoopRestarts=2",
        "--set",
        "operator.unschedulableSeconds=5",
        "--wait",
        "--timeout",
        "3m",
    )
    print(
        f"[realnode] helm install: operator ready in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
    yield OPERATOR_NAMESPACE
    logs = node.kubectl("logs", "-n", OPERATOR_NAMESPACE, "deploy/omnipipe", check=False)
    errors = [
        line
        for line in logs.stdout.splitlines()
        if (" ERROR " in line or "is forbidden: User" in line)
        and not any(marker in line for marker in EXPECTED_OPERATOR_ERRORS)
    ]
    assert errors == [], "the operator logged errors:\n" + "\n".join(errors)


_namespaces = iter(range(1, 10_000))


@pytest.fixture
def namespace(node: RealNode) -> Iterator[str]:
    name = f"rn{next(_namespaces)}"
    node.kubectl("create", "namespace", name)
    yield name
    node.kubectl("delete", "namespace", name, "--wait=false")


def wait_for(what: str, check: Callable[[], Any], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def get_json(node: RealNode, *args: str) -> Any:
    return json.loads(node.kubectl("get", *args, "-o", "json").stdout)


def router_url(node: RealNode, namespace: str, pipeline: str) -> str:
    """The router's Service, by its ClusterIP (the host reaches Services through the node),
    once it answers. A pod is Ready (and so the pipeline) a moment before kube-proxy has
    its rules for the Service: until then the node has no route for the ClusterIP and a
    connection fails with ENETUNREACH (seen in CI as the first of four load clients'
    requests failing at 0.1 s)."""
    ip = node.kubectl(
        "get",
        "service",
        f"{pipeline}-router",
        "-n",
        namespace,
        "-o",
        "jsonpath={.spec.clusterIP}",
    ).stdout.strip()
    wait_for(
        f"the {pipeline} router's Service to answer",
        lambda: _answers(f"http://{ip}:8000/health"),
        60,
    )
    return f"http://{ip}:8000/v1"


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except urllib.error.HTTPError:
        return True  # an answer all the same: the Service reached the router
    except OSError:
        return False


def condition(node: RealNode, namespace: str, pipeline: str, kind: str) -> str:
    return str(
        node.kubectl(
            "get",
            "omnipipeline",
            pipeline,
            "-n",
            namespace,
            "-o",
            f'jsonpath={{.status.conditions[?(@.type=="{kind}")].status}}',
            check=False,
        ).stdout.strip()
    )


def apply_and_wait_ready(
    node: RealNode, namespace: str, manifest: Path | str, pipeline: str, timeout: int = 600
) -> float:
    """kubectl apply -f, then kubectl wait --for=condition=Ready; the seconds it took."""
    started = time.monotonic()
    if isinstance(manifest, Path):
        node.kubectl("apply", "-n", namespace, "-f", str(manifest))
    else:
        node.kubectl("apply", "-n", namespace, "-f", "-", input=manifest)
    # The status (and so the condition) appears a moment after the object: kubectl wait
    # on a missing condition fails at once, so the first wait is a poll.
    wait_for("a Ready condition", lambda: condition(node, namespace, pipeline, "Ready"), 60)
    waited = node.kubectl(
        "wait",
        "-n",
        namespace,
        "--for=condition=Ready",
        f"omnipipeline/{pipeline}",
        f"--timeout={timeout}s",
        timeout=timeout + 30,
        check=False,
    )
    if waited.returncode != 0:
        raise AssertionError(
            f"{pipeline} never Ready: {waited.stderr}\n{diagnose(node, namespace)}"
        )
    return time.monotonic() - started


def gitops_verdicts(node: RealNode, namespace: str, name: str) -> tuple[str, str]:
    """(kstatus' status, Argo CD's health status) of the pipeline as it is now."""
    obj = get_json(node, "omnipipeline", name, "-n", namespace)
    return kstatus(obj)[0], argo_health(obj)[0]


@dataclass(frozen=True)
class Verdict:
    """One reading of a live pipeline, as kubectl wait, Flux and Argo CD see it."""

    ready: str
    flux: str
    argo: str
    below_capacity: bool  # some stage has fewer ready replicas than it asks for now


@contextmanager
def verdict_watch(node: RealNode, namespace: str, name: str) -> Iterator[list[Verdict]]:
    """Every reading of the pipeline (twice a second) while the block runs."""
    seen: list[Verdict] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            obj = get_json(node, "omnipipeline", name, "-n", namespace)
            status = obj.get("status") or {}
            conds = {c["type"]: c["status"] for c in status.get("conditions") or []}
            below = any(
                s.get("readyReplicas", 0) < s.get("desiredReplicas", 0)
                for s in status.get("stages") or []
            )
            seen.append(
                Verdict(conds.get("Ready", ""), kstatus(obj)[0], argo_health(obj)[0], below)
            )
            time.sleep(0.5)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield seen
    finally:
        stop.set()
        t.join(timeout=10)


def diagnose(node: RealNode, namespace: str) -> str:
    """What a person would look at: the pipeline's status, the pods, and the log tail of
    every pod that is not ready."""
    parts = [
        node.kubectl("get", "omnipipeline,pods", "-n", namespace, "-o", "wide", check=False).stdout,
        node.kubectl(
            "get",
            "omnipipeline",
            "-n",
            namespace,
            "-o",
            "jsonpath={.items[*].status.conditions}",
            check=False,
        ).stdout,
    ]
    for p in get_json(node, "pods", "-n", namespace)["items"]:
        statuses = p["status"].get("containerStatuses", [])
        if statuses and all(s.get("ready") for s in statuses):
            continue
        name = p["metadata"]["name"]
        parts.append(f"--- {name}: {json.dumps(statuses)[:1500]}")
        for previous in ("--previous", None):
            flags = [previous] if previous else []
            logs = node.kubectl("logs", "-n", namespace, name, "--tail=40", *flags, check=False)
            parts.append(logs.stdout[-4000:] or logs.stderr[-500:])
    return "\n".join(parts)


def pods(node: RealNode, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(node, "pods", "-n", namespace, "-l", selector)["items"]
    return items
