"""How fast a stage reacts to a load step: omnipipe's autoscaler, live, beside
Kubernetes' HPA defaults replayed on the same signal.

Runs the real thing: the test control plane (etcd, kube-apiserver, controller-manager,
scheduler, kwok), Debian's prometheus scraping `omnipipe serve` workers, and the
operator. A load step hits the local workers; we time the operator's scale-up decision
and the new replica count being ready, then the scale-down after the load stops.

The anchor is the HPA's default behaviour (15 s sync period, 10% tolerance, no scale-up
window, 300 s scale-down window) applied by the same policy code to the very signal
series Prometheus recorded, at every possible sync phase; the median phase is reported.

    .venv/bin/python bench/autoscale_reaction.py [--quick] [--interval 15]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from _common import REPO, median, record, table

from omnipipe.local.ports import free_port
from omnipipe.operator.autoscaler.policy import Decision, Observation, Policy, decide
from omnipipe.operator.autoscaler.queries import SignalKind
from tests.e2e.conftest import Served, start_serve, write_pipeline
from tests.harness.cluster import control_plane, service_account_kubeconfig
from tests.harness.prometheus import prometheus

NAMESPACE = "bench"
HPA_SYNC = 15.0
QUICK_HPA_SYNC = 4.0
HPA_DOWN_WINDOW = 300.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def replicas(kubectl: list[str], field: str) -> int:
    out = subprocess.run(
        [
            *kubectl,
            "get",
            "deployment",
            "-l",  # by labels: the Deployment's name carries the pipeline's revision
            "omnipipe.io/pipeline=react,omnipipe.io/stage=denoise",
            "-n",
            NAMESPACE,
            "-o",
            f"jsonpath={{.items[0]{field}}}",
        ],
        capture_output=True,
        text=True,
    ).stdout
    return int(out or 0)


def hpa_replay(
    series: list[tuple[float, float]], t0: float, target: float, max_replicas: int, sync: float
) -> tuple[float, float]:
    """Seconds after t0 until the HPA default would scale up, and scale down after the
    load stops, for each 1 s phase of its `sync` period; returns the medians."""
    ups, downs = [], []
    # HPA's default scale-up policy allows max(4 pods, 100%) per period; from 1 that is 4.
    policy = Policy(SignalKind.TOTAL, target, 1, max_replicas, 4, 0.1, 0.0, HPA_DOWN_WINDOW)
    # After the last load step the signal stays at zero: extend it far enough for the
    # HPA's 300 s window to run out.
    last = series[-1][0]
    series = series + [(last + k, 0.0) for k in range(1, int(HPA_DOWN_WINDOW + 3 * sync))]
    end = series[-1][0]
    for phase in range(int(sync)):
        current, history, up_at, down_at = 1, (), None, None
        t = series[0][0] + phase
        while t <= end:
            value = next((v for ts, v in reversed(series) if ts <= t), 0.0)
            d: Decision = decide(
                policy, current, current, Observation(value, 0.0, 0.0), history, t, 60.0
            )
            history = d.history
            if d.desired > current and up_at is None:
                up_at = t
            if d.desired < current and down_at is None and up_at is not None:
                down_at = t
            current = d.desired
            t += sync
        if up_at is not None:
            ups.append(up_at - t0)
        if down_at is not None:
            downs.append(down_at - t0)
    return median(ups), median(downs)


@contextmanager
def kept_on_failure(work: Path) -> Iterator[None]:
    """The run's folder (etcd's data, the logs: tens of MB) is removed once all in it has
    stopped, unless the run failed: then it stays, for its logs."""
    try:
        yield
    except BaseException:
        log(f"failed: the operator's, the control plane's and prometheus's logs stay in {work}")
        raise
    shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short load and windows")
    parser.add_argument(
        "--interval",
        type=float,
        default=None,
        help="operator autoscale interval in seconds (default 15; --quick 2)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="load steps (default 3; quick 1)")
    args = parser.parse_args()
    interval = args.interval or (2.0 if args.quick else 15.0)
    rounds = args.rounds or (1 if args.quick else 3)
    # A load step lasts past the replayed HPA's sync period and two of the operator's
    # intervals (the signal's lag), so that a sync from every phase sees it. --quick
    # replays the HPA at a shorter period, and shortens the operator's scale-down window,
    # so that its one step is seconds: it proves the path, not the HPA's figures.
    hpa_sync = QUICK_HPA_SYNC if args.quick else HPA_SYNC
    down_window = 3 if args.quick else 60
    load_seconds = hpa_sync + 2 * interval if args.quick else 60
    work = Path(tempfile.mkdtemp(prefix="omnipipe-bench-"))

    log(f"starting control plane, prometheus and workers in {work}")
    # One request at a time, so demand is a clean step, not a batch-shaped sawtooth.
    react = write_pipeline(work, "react", transfer="tcp")
    with (
        kept_on_failure(work),
        serve_of(react, {"OMNIPIPE_WORKER_MAX_BATCH": "1"}, early=args.quick) as take_serve,
        control_plane(work / "k8s", with_pods=True) as cluster,
        prometheus(work / "prom") as prom,
    ):
        kubectl = [str(cluster.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}"]
        subprocess.run(
            [
                *kubectl,
                "apply",
                "--server-side",
                "-f",
                str(REPO / "crds/omnipipelines.omnipipe.io.yaml"),
            ],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [*kubectl, "apply", "-f", str(REPO / "deploy/operator-rbac.yaml")],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [*kubectl, "create", "namespace", NAMESPACE], check=True, capture_output=True
        )

        def scraped_serve() -> Served:
            served = take_serve()
            prom.set_targets(
                [
                    {
                        "targets": [served.workers["denoise-0"][0].removeprefix("http://")],
                        "labels": {"namespace": NAMESPACE},
                    }
                ]
            )
            return served

        # --quick: the operator starts and reconciles while the workers are still starting.
        served = None if args.quick else scraped_serve()
        env = cluster.env(
            service_account_kubeconfig(cluster, "omnipipe-system", "omnipipe-operator")
        )
        env.update(
            {
                "OMNIPIPE_OPERATOR_AUTOSCALE_INTERVAL_SECONDS": str(interval),
                "OMNIPIPE_OPERATOR_METRIC_MAX_AGE_SECONDS": "30",
                "OMNIPIPE_OPERATOR_METRICS_PORT": str(free_port()),
                "OMNIPIPE_OPERATOR_HEALTH_PORT": str(free_port()),
            }
        )
        operator = subprocess.Popen(
            [sys.executable, "-m", "omnipipe.cli", "operator"],
            env=env,
            stdout=(work / "operator.log").open("wb"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        # 4 clients keep >= 3 requests in flight: always above max_replicas x target.
        target, max_replicas = 0.5, 4
        manifest = {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": "react"},
            "spec": {
                "model": "tiny://qwen-image",
                "pipeline": "qwen-image",
                "prometheusUrl": prom.url,
                "stages": [
                    {
                        "name": "denoise",
                        "autoscaling": {
                            "minReplicas": 1,
                            "maxReplicas": max_replicas,
                            "target": target,
                            "maxStep": 4,
                            "scaleDownStabilizationSeconds": down_window,
                        },
                    }
                ],
            },
        }
        subprocess.run(
            [*kubectl, "apply", "-n", NAMESPACE, "-f", "-"],
            input=json.dumps(manifest),
            text=True,
            check=True,
            capture_output=True,
        )
        ours: dict[str, list[float]] = {"up_decision": [], "up_ready": [], "down_decision": []}
        hpa: dict[str, list[float]] = {"up_decision": [], "down_decision": []}
        try:
            served = served or scraped_serve()
            while replicas(kubectl, ".status.readyReplicas") != 1:
                time.sleep(0.5)
            for r in range(rounds):
                log(f"round {r + 1}/{rounds}: load step for {load_seconds}s")
                stop = threading.Event()
                threads = [
                    threading.Thread(target=_load, args=(served.base_url, stop)) for _ in range(4)
                ]
                t0 = time.time()
                for t in threads:
                    t.start()
                up = ready = None
                while time.time() - t0 < load_seconds:
                    if up is None and replicas(kubectl, ".spec.replicas") > 1:
                        up = time.time() - t0
                    if ready is None and replicas(kubectl, ".status.readyReplicas") > 1:
                        ready = time.time() - t0
                    time.sleep(0.2)
                stop.set()
                t_stop = time.time()
                for t in threads:
                    t.join()
                down = None
                while down is None and time.time() - t_stop < down_window * 3 + 60:
                    if replicas(kubectl, ".spec.replicas") == 1:
                        down = time.time() - t_stop
                    time.sleep(0.2)
                log(f"  omnipipe: up decision {up}s, up ready {ready}s, down {down}s after stop")
                ours["up_decision"].append(up or float("nan"))
                ours["up_ready"].append(ready or float("nan"))
                ours["down_decision"].append(down or float("nan"))
                series = _series(prom.url, t0 - 5, time.time())
                hpa_up, hpa_down = hpa_replay(series, t0, target, max_replicas, hpa_sync)
                hpa["up_decision"].append(hpa_up)
                hpa["down_decision"].append(hpa_down - (t_stop - t0))
                if not args.quick or r < rounds - 1:  # --quick: no pause after the last
                    time.sleep(2)
        finally:
            operator.terminate()
            operator.wait(timeout=30)
            if served is not None:
                served.stop()

    rows = {
        "up_decision_s": median(ours["up_decision"]),
        "up_ready_s": median(ours["up_ready"]),
        "down_decision_s": median(ours["down_decision"]),
        "hpa_up_decision_s": median(hpa["up_decision"]),
        "hpa_down_decision_s": median(hpa["down_decision"]),
        "interval_s": interval,
        "down_window_s": down_window,
        "hpa_sync_s": hpa_sync,
        "rounds": rounds,
    }
    ratio_up = rows["hpa_up_decision_s"] / rows["up_decision_s"]
    default = hpa_sync == HPA_SYNC
    hpa_name = "HPA default (replayed)" if default else f"HPA (replayed, sync {hpa_sync:g}s)"
    print()
    print(
        table(
            ["metric (median)", "omnipipe", hpa_name, "HPA/omnipipe"],
            [
                [
                    "load step -> scale-up decision",
                    f"{rows['up_decision_s']:.1f} s",
                    f"{rows['hpa_up_decision_s']:.1f} s",
                    f"{ratio_up:.2f}x",
                ],
                [
                    "load step -> new replica ready",
                    f"{rows['up_ready_s']:.1f} s",
                    "n/a (+ pod start)",
                    "",
                ],
                [
                    "load stop -> scale-down",
                    f"{rows['down_decision_s']:.1f} s",
                    f"{rows['hpa_down_decision_s']:.1f} s",
                    f"{rows['hpa_down_decision_s'] / rows['down_decision_s']:.2f}x",
                ],
            ],
        )
    )
    print(
        f"(omnipipe: interval {interval:g}s, scale-down window {down_window}s; "
        f"HPA: sync {hpa_sync:g}s, scale-down window {HPA_DOWN_WINDOW:g}s)"
    )
    record("autoscale_reaction", rows, args.quick)
    print(
        f"autoscale_reaction: up_decision_s={rows['up_decision_s']:.1f} "
        f"hpa_up_decision_s={rows['hpa_up_decision_s']:.1f} "
        f"down_s={rows['down_decision_s']:.1f} hpa_down_s={rows['hpa_down_decision_s']:.1f} "
        f"up_ratio={ratio_up:.2f}"
    )
    return 0


@contextmanager
def serve_of(pipeline: Path, env: dict[str, str], early: bool) -> Iterator[Callable[[], Served]]:
    """take() gives a serve of `pipeline`, started when called, or (early: --quick) started
    now in the background, beside what the caller starts next; if that one is never
    taken, it is stopped on the way out."""
    future = ThreadPoolExecutor(1).submit(start_serve, pipeline, env) if early else None
    taken: list[Served] = []

    def take() -> Served:
        taken.append(future.result() if future else start_serve(pipeline, env=env))
        return taken[-1]

    try:
        yield take
    finally:
        if future is not None and not taken and future.exception() is None:
            future.result().stop()


def _load(base_url: str, stop: threading.Event) -> None:
    import openai

    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120) as c:
        while not stop.is_set():
            c.images.generate(
                model="react", prompt="load", size="256x256", extra_body={"num_inference_steps": 30}
            )


def _series(url: str, start: float, end: float) -> list[tuple[float, float]]:
    q = (
        'sum(omnipipe_stage_requests_running{pipeline="react",stage="denoise"}) + '
        'sum(omnipipe_stage_requests_waiting{pipeline="react",stage="denoise"})'
    )
    params = urllib.parse.urlencode({"query": q, "start": start, "end": end, "step": 1})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{params}", timeout=10) as r:
        result = json.loads(r.read())["data"]["result"]
    return [(float(ts), float(v)) for ts, v in result[0]["values"]] if result else []


if __name__ == "__main__":
    raise SystemExit(main())
