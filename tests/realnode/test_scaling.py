"""Autoscaling on real pods: Prometheus scrapes the router and stage pods through Kubernetes
service discovery, the operator (a pod) reads it, and the denoise stage goes 1 -> 2 under
load, the new pod gets work, the pipeline stays Ready, and it goes back to 1 when idle.
A stage at zero wakes for a request the router holds."""

from __future__ import annotations

import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
import yaml

from tests.harness.node import RealNode
from tests.harness.prometheus import Prometheus
from tests.realnode.conftest import (
    apply_and_wait_ready,
    condition,
    pods,
    router_url,
    verdict_watch,
    wait_for,
)

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(900)]
DENOISE = "omnipipe.io/stage=denoise"


def manifest(name: str, autoscaling: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": name},
            "spec": {
                "model": "tiny://qwen-image",
                "pipeline": "qwen-image",
                "stages": [
                    {
                        "name": "denoise",
                        "autoscaling": autoscaling,
                        # One request at a time: demand then stays steady under load.
                        "maxBatch": 1,
                        # One thread (the worker takes OMP_NUM_THREADS as its budget): the
                        # realnode tier shares the machine's 2 cores with the other tiers,
                        # and a 2-thread OpenMP team there waited on its descheduled half
                        # at every barrier, so a 0.45 s request took about 50 s and the
                        # load's first requests timed out (CI, cold). Not resources.cpu:
                        # two replicas' requests of a core each do not fit the node.
                        "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
                    }
                ],
            },
        }
    )


def deployment_replicas(node: RealNode, namespace: str, name: str) -> int | None:
    out = node.kubectl(
        "get",
        "deployment",
        "-n",
        namespace,
        "-l",
        f"omnipipe.io/pipeline={name},{DENOISE}",
        "-o",
        "jsonpath={.items[*].spec.replicas}",
        check=False,
    ).stdout.split()
    return int(out[0]) if out else None


def ready_pods(node: RealNode, namespace: str, name: str) -> list[dict[str, Any]]:
    return [
        p
        for p in pods(node, namespace, f"omnipipe.io/pipeline={name},{DENOISE}")
        if p.get("metadata", {}).get("deletionTimestamp") is None
        and all(s.get("ready") for s in p["status"].get("containerStatuses", [{}]))
        and p["status"].get("containerStatuses")
    ]


def completed(pod: dict[str, Any]) -> float:
    """Requests this stage pod has finished, from its own /metrics."""
    url = f"http://{pod['status']['podIP']}:8100/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("omnipipe_stage_request_duration_seconds_count")
    )


@contextmanager
def load(url: str, clients: int, model: str) -> Iterator[list[str]]:
    """`clients` threads sending image requests back to back until the block ends."""
    stop = threading.Event()
    errors: list[str] = []
    started = time.monotonic()

    def run() -> None:
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
            while not stop.is_set():
                try:
                    c.images.generate(
                        model=model,
                        prompt="a lighthouse",
                        # Denoise-bound: 200 steps at 64x64 take ~0.45 s there, and
                        # the other stages ~30 ms (256x256 was bound by decode, so
                        # denoise never held more than one request).
                        size="64x64",
                        extra_body={"num_inference_steps": 200},
                    )
                except Exception as exc:
                    # When and why: openai's APIConnectionError hides its cause.
                    errors.append(
                        f"{time.monotonic() - started:.1f} s: {exc!r} from {exc.__cause__!r}"
                    )

    threads = [threading.Thread(target=run, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        yield errors
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=130)


def scaling_report(node: RealNode, prom: Prometheus, namespace: str, name: str) -> str:
    """What the autoscaler saw: the pipeline's scaling status, what Prometheus holds for
    the stage, and the operator's log tail."""
    status = node.kubectl(
        "get", "omnipipeline", name, "-n", namespace, "-o", "jsonpath={.status}", check=False
    ).stdout
    series = [
        (m["metric"].get("__name__"), m["metric"].get("pod"), m["value"][1])
        for m in prom.query(f'{{namespace="{namespace}",pipeline="{name}",stage="denoise"}}')
        if "running" in m["metric"].get("__name__", "")
        or "waiting" in m["metric"].get("__name__", "")
    ]
    logs = node.kubectl(
        "logs", "-n", "omnipipe-system", "deploy/omnipipe", "--tail=40", check=False
    ).stdout
    return f"status: {status}\nprometheus: {series}\noperator log:\n{logs}"


def pipeline_pods(node: RealNode, namespace: str, name: str) -> str:
    """Every pod of the pipeline with its restarts, the namespace's recent events, and the
    pods' last log lines."""
    listing = node.kubectl(
        "get",
        "pods",
        "-n",
        namespace,
        "-l",
        f"omnipipe.io/pipeline={name}",
        "-o",
        "wide",
        check=False,
    ).stdout
    events = node.kubectl("get", "events", "-n", namespace, check=False).stdout
    # What the stages and the router said: where a request waited shows in their logs.
    logs = node.kubectl(
        "logs",
        "-n",
        namespace,
        "-l",
        f"omnipipe.io/pipeline={name}",
        "--all-containers",
        "--prefix",
        "--timestamps",
        "--tail=60",
        "--max-log-requests=10",
        check=False,
    ).stdout
    return f"pods:\n{listing}\nevents:\n{events[-3000:]}\nlogs:\n{logs[-12000:]}"


def test_denoise_scales_up_under_load_serves_on_the_new_pod_and_back(
    node: RealNode, operator: str, prom: Prometheus, namespace: str
) -> None:
    name = "scaled"
    apply_and_wait_ready(
        node,
        namespace,
        manifest(
            name,
            {
                "minReplicas": 1,
                "maxReplicas": 2,
                "metric": "inflight",
                "target": 1,
                "scaleDownStabilizationSeconds": 10,
            },
        ),
        name,
    )
    assert deployment_replicas(node, namespace, name) == 1
    (first,) = ready_pods(node, namespace, name)
    url = router_url(node, namespace, name)
    # Prometheus found the pods by service discovery, labelled as the autoscaler asks.
    wait_for(
        "Prometheus to scrape the denoise pod",
        lambda: prom.query(
            f'omnipipe_stage_requests_running{{namespace="{namespace}",pipeline="{name}",'
            'stage="denoise"}'
        ),
        60,
    )
    with verdict_watch(node, namespace, name) as readings, load(url, 4, name) as errors:
        try:
            wait_for(
                "the autoscaler to ask for 2 replicas",
                lambda: deployment_replicas(node, namespace, name) == 2,
                120,
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{scaling_report(node, prom, namespace, name)}") from None
        asked = time.monotonic()
        new = wait_for(
            "the second denoise pod to be ready",
            lambda: [
                p
                for p in ready_pods(node, namespace, name)
                if p["metadata"]["name"] != first["metadata"]["name"]
            ],
            300,
        )[0]
        ready_at = time.monotonic()
        wait_for("the new pod to finish a request", lambda: completed(new) > 0, 120)
        print(
            f"[realnode] scale-up: pod ready {ready_at - asked:.1f} s after the autoscaler "
            f"asked, first request done {time.monotonic() - ready_at:.1f} s after ready",
            file=sys.stderr,
        )
    assert errors == [], f"{errors[:3]}\n{pipeline_pods(node, namespace, name)}"
    # Serving is what Ready means: the first pod served while the second started. Flux
    # (kstatus) and Argo CD read the same: Current and Healthy through the scale-up.
    assert readings, "the pipeline was never read"
    assert any(r.below_capacity for r in readings), "no reading during the scale-up"
    assert {(r.ready, r.flux, r.argo) for r in readings} == {("True", "Current", "Healthy")}, [
        r for r in readings if (r.ready, r.flux, r.argo) != ("True", "Current", "Healthy")
    ][:5]
    wait_for(
        "the autoscaler to scale back to 1 when idle",
        lambda: deployment_replicas(node, namespace, name) == 1,
        180,
    )
    assert condition(node, namespace, name, "Ready") == "True"


def test_a_request_wakes_a_stage_scaled_to_zero(
    node: RealNode, operator: str, prom: Prometheus, namespace: str
) -> None:
    name = "sleepy"
    apply_and_wait_ready(
        node,
        namespace,
        manifest(
            name,
            {
                "minReplicas": 0,
                "maxReplicas": 1,
                "metric": "inflight",
                "target": 1,
                "scaleDownStabilizationSeconds": 5,
            },
        ),
        name,
    )
    wait_for(
        "denoise to scale to zero", lambda: deployment_replicas(node, namespace, name) == 0, 180
    )
    wait_for(
        "the denoise pod to be gone",
        lambda: not pods(node, namespace, f"omnipipe.io/pipeline={name},{DENOISE}"),
        120,
    )
    # A stage at zero still serves: it wakes on demand.
    assert condition(node, namespace, name, "Ready") == "True"
    started = time.monotonic()
    with openai.OpenAI(
        base_url=router_url(node, namespace, name), api_key="unused", max_retries=0, timeout=300
    ) as client:
        r = client.images.generate(
            model=name,
            prompt="a lighthouse",
            size="64x64",
            extra_body={"num_inference_steps": 2},
        )
    assert r.data[0].b64_json
    print(
        f"[realnode] scale from zero: held request answered in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
    assert deployment_replicas(node, namespace, name) == 1
