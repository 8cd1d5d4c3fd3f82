"""How the operator keeps up: `kubectl apply` of N = 1, 50 and 200 OmniPipelines on the
real test control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
kwok), timed until every pipeline reports Ready (its Deployments available, pods Running
on kwok nodes); the operator's CPU seconds and peak RSS; and the API requests it made per
pipeline, from the API server's own metrics (API Priority and Fairness counts requests
per FlowSchema; the operator is the only client in the `service-accounts` schema).

The anchor is the floor without an operator: `kubectl apply` of the very manifests the
operator would write (`omnipipe render`), timed until every Deployment is Available.

    .venv/bin/python bench/reconcile.py [--quick] [--sizes 1,50,200]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import REPO, median, record, table
from _procs import wait_http

from omnipipe.local.ports import free_port
from tests.harness.cluster import Cluster, control_plane, service_account_kubeconfig

OPERATOR_SCHEMA = "service-accounts"
# A run at larger N takes minutes (200 pipelines: over 3 with stock controllers), so one run.
MAX_REPEATED_N = 50
DISPATCHED = re.compile(
    r'^apiserver_flowcontrol_dispatched_requests_total\{[^}]*flow_schema="([^"]+)"[^}]*\} (\S+)$'
)


def log(message: str) -> None:
    print(message, flush=True)


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over runs; peak RSS is a high-water mark, so its maximum."""
    out = {key: median([r[key] for r in runs]) for key in runs[0]}
    if "peak_rss_mib" in out:
        out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    return out


def delete_namespaces(cluster: Cluster, *namespaces: str) -> None:
    cluster.kubectl("delete", "namespace", *namespaces, "--wait=true", timeout=600)


def manifests(n: int, prefix: str) -> str:
    docs = []
    for i in range(n):
        docs.append(
            f"""apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {{name: {prefix}-{i}}}
spec:
  model: tiny://qwen-image
  pipeline: qwen-image
"""
        )
    return "---\n".join(docs)


def dispatched(cluster: Cluster) -> dict[str, float]:
    raw = cluster.kubectl("get", "--raw", "/metrics", timeout=120).stdout
    totals: dict[str, float] = {}
    for line in raw.splitlines():
        if m := DISPATCHED.match(line):
            totals[m[1]] = totals.get(m[1], 0.0) + float(m[2])
    return totals


def ready_count(cluster: Cluster, namespace: str) -> int:
    items = json.loads(
        cluster.kubectl("get", "omnipipelines", "-n", namespace, "-o", "json", timeout=120).stdout
    )["items"]
    count = 0
    for item in items:
        conditions = item.get("status", {}).get("conditions", [])
        if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
            count += 1
    return count


def available_deployments(cluster: Cluster, namespace: str) -> tuple[int, int]:
    items = json.loads(
        cluster.kubectl("get", "deployments", "-n", namespace, "-o", "json", timeout=120).stdout
    )["items"]
    ready = sum(
        1
        for d in items
        if any(
            c["type"] == "Available" and c["status"] == "True"
            for c in d.get("status", {}).get("conditions", [])
        )
    )
    return ready, len(items)


class OperatorProcess:
    def __init__(self, cluster: Cluster, work: Path) -> None:
        env = cluster.env(
            service_account_kubeconfig(cluster, "omnipipe-system", "omnipipe-operator")
        )
        env.update(
            {
                # No periodic re-apply during the measurement: it would add requests that are
                # not the reaction to the apply being measured.
                "OMNIPIPE_OPERATOR_DRIFT_CHECK_SECONDS": "86400",
                "OMNIPIPE_OPERATOR_METRICS_PORT": str(free_port()),
                "OMNIPIPE_OPERATOR_HEALTH_PORT": str(health := free_port()),
            }
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnipipe.cli", "operator"],
            env=env,
            cwd=REPO,
            stdout=(work / "operator.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        # Measure reconciling, not the operator's start-up (imports, login, watches).
        wait_http(f"http://127.0.0.1:{health}/healthz", timeout=120, proc=self.proc)

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        return ticks / 100.0

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


def new_namespace(cluster: Cluster, namespace: str) -> None:
    """Pods cannot be created before the namespace's default ServiceAccount exists; the
    ReplicaSet controller would back off (seconds), so wait for it outside the timing."""
    cluster.kubectl("create", "namespace", namespace)
    wait_until(
        lambda: (
            cluster.kubectl(
                "get", "serviceaccount", "default", "-n", namespace, check=False
            ).returncode
            == 0
        ),
        60,
        f"the default ServiceAccount of {namespace}",
    )


def measure_operator(
    cluster: Cluster,
    operator: OperatorProcess,
    n: int,
    work: Path,
    namespace: str,
    settle_s: float = 2.0,
) -> dict[str, float]:
    new_namespace(cluster, namespace)
    before_requests = dispatched(cluster).get(OPERATOR_SCHEMA, 0.0)
    before_cpu = operator.cpu_seconds()
    started = time.monotonic()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifests(n, "p"), timeout=300)
    wait_until(lambda: ready_count(cluster, namespace) == n, 600 + 5 * n, f"{n} pipelines Ready")
    elapsed = time.monotonic() - started
    time.sleep(settle_s)  # let the last status writes land before reading the counters
    requests = dispatched(cluster).get(OPERATOR_SCHEMA, 0.0) - before_requests
    return {
        "ready_s": elapsed,
        "cpu_s": operator.cpu_seconds() - before_cpu,
        "peak_rss_mib": operator.peak_rss_mib(),
        "api_requests": requests,
        "requests_per_pipeline": requests / n,
    }


def measure_direct(cluster: Cluster, n: int, work: Path, namespace: str) -> dict[str, float]:
    new_namespace(cluster, namespace)
    rendered = []
    for i in range(n):
        path = work / f"d{i}.yaml"
        path.write_text(manifests(1, f"d{i}").replace("d0-0", f"d-{i}"))
        rendered.append(
            subprocess.run(
                [sys.executable, "-m", "omnipipe.cli", "render", str(path), "-n", namespace],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO,
            ).stdout
        )
    started = time.monotonic()
    cluster.kubectl(
        "apply",
        "--server-side",
        "-n",
        namespace,
        "-f",
        "-",
        input="\n---\n".join(rendered),
        timeout=300,
    )
    expected = 4 * n  # three stages and the router per pipeline
    wait_until(
        lambda: available_deployments(cluster, namespace) == (expected, expected),
        600 + 5 * n,
        f"{expected} Deployments Available",
    )
    return {"ready_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 1 and 3, one run each")
    parser.add_argument("--sizes", help="comma-separated N values (default 1,50,200)")
    parser.add_argument(
        "--repeats",
        type=int,
        help=f"runs per N up to {MAX_REPEATED_N}, medians reported (default 3; --quick 1); "
        "larger N run once",
    )
    parser.add_argument(
        "--controller-qps",
        type=int,
        help="client rate limit of the controller-manager and scheduler (default: theirs, "
        "20 and 50/s, which set the floor for large N; raise it to see the operator's own pace)",
    )
    args = parser.parse_args()
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else ([1, 3] if args.quick else [1, 50, 200])
    )
    repeats = args.repeats or (1 if args.quick else 3)
    results: dict[str, dict[str, dict[str, float]]] = {"omnipipe": {}, "direct": {}}
    all_runs: dict[str, dict[str, list[dict[str, float]]]] = {"omnipipe": {}, "direct": {}}
    with tempfile.TemporaryDirectory(prefix="bench-reconcile-") as tmp:
        work = Path(tmp)
        log("starting the control plane (etcd, apiserver, controller-manager, scheduler, kwok)")
        with control_plane(
            work / "k8s", with_pods=True, controller_api_qps=args.controller_qps
        ) as cluster:
            cluster.add_fake_node("kwok-node-1")  # room for 2 x 4 x 200 pods
            cluster.kubectl(
                "apply", "--server-side", "-f", str(REPO / "crds/omnipipelines.omnipipe.io.yaml")
            )
            cluster.wait_crd_established("omnipipelines.omnipipe.io")
            cluster.kubectl("apply", "-f", str(REPO / "deploy/operator-rbac.yaml"))
            operator = OperatorProcess(cluster, work)
            # --quick: no warm-up (the first run pays the operator's first watch events
            # and caches), a shorter settle and no clean-up between runs: a smoke run
            # checks that each figure is read, and its few pipelines do not slow the next.
            settle_s = 0.5 if args.quick else 2.0
            try:
                if not args.quick:
                    # Warm-up, not measured: the operator's first watch events and caches.
                    log("warm-up: one pipeline to Ready (not measured)")
                    measure_operator(cluster, operator, 1, work, "warm-up")
                for n in sizes:
                    runs = repeats if n <= MAX_REPEATED_N else 1
                    direct, ours = [], []
                    for r in range(runs):
                        log(f"N={n} run {r + 1}/{runs}: direct apply of the rendered children ...")
                        direct.append(measure_direct(cluster, n, work, f"direct-{n}-{r}"))
                        log(f"N={n} run {r + 1}/{runs}: kubectl apply of {n} OmniPipelines ...")
                        ours.append(
                            measure_operator(cluster, operator, n, work, f"op-{n}-{r}", settle_s)
                        )
                        log(
                            f"    ready in {ours[-1]['ready_s']:.1f}s "
                            f"(direct {direct[-1]['ready_s']:.1f}s)"
                        )
                        if not args.quick and (n != sizes[-1] or r != runs - 1):
                            # Each run starts from the same cluster, not one that grew.
                            delete_namespaces(cluster, f"direct-{n}-{r}", f"op-{n}-{r}")
                    all_runs["direct"][str(n)], all_runs["omnipipe"][str(n)] = direct, ours
                    results["direct"][str(n)] = medians(direct)
                    results["omnipipe"][str(n)] = medians(ours)
            finally:
                operator.stop()
    rows = []
    for n in sizes:
        ours, direct = results["omnipipe"][str(n)], results["direct"][str(n)]
        rows.append(
            [
                str(n),
                f"{ours['ready_s']:.1f}",
                f"{direct['ready_s']:.1f}",
                f"{ours['ready_s'] / direct['ready_s']:.2f}",
                f"{ours['cpu_s']:.1f}",
                f"{ours['peak_rss_mib']:.0f}",
                f"{ours['requests_per_pipeline']:.1f}",
            ]
        )
    print()
    print(
        table(
            [
                "N",
                "omnipipe ready s",
                "direct apply ready s",
                "ratio",
                "operator CPU s",
                "peak RSS MiB",
                "API requests / pipeline",
            ],
            rows,
        )
    )
    qps = f"{args.controller_qps}/s" if args.controller_qps else "their defaults"
    print(
        f"(medians of {repeats} runs for N <= {MAX_REPEATED_N}, one run above; "
        f"kwok pods, no images pulled; controller-manager and scheduler rate limit: {qps})"
    )
    record(
        "reconcile",
        {**results, "runs": all_runs, "controller_api_qps": args.controller_qps},
        args.quick,
    )
    top = str(sizes[-1])
    summary = {
        f"ready_s_n{top}": results["omnipipe"][top]["ready_s"],
        f"vs_direct_n{top}": results["omnipipe"][top]["ready_s"]
        / results["direct"][top]["ready_s"],
        f"cpu_s_n{top}": results["omnipipe"][top]["cpu_s"],
        "peak_rss_mib": results["omnipipe"][top]["peak_rss_mib"],
        f"requests_per_pipeline_n{top}": results["omnipipe"][top]["requests_per_pipeline"],
    }
    print("reconcile: " + " ".join(f"{k}={v:.3g}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
