"""Autoscaling end to end: real workers (omnipipe serve) under load, a real Prometheus
scraping them, and the operator scaling the matching Deployment in the real API server."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.e2e.conftest import Served, start_serve, write_pipeline
from tests.harness.cluster import Cluster
from tests.harness.prometheus import Prometheus, prometheus
from tests.integration.conftest import Operator, get_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # One request at a time: demand then stays steady instead of dipping between batches.
    s = start_serve(
        write_pipeline(tmp_path_factory.mktemp("scaled"), "scaled", transfer="tcp"),
        env={"OMNIPIPE_WORKER_MAX_BATCH": "1"},
    )
    yield s
    s.stop()


def apply_pipeline(
    cluster: Cluster, namespace: str, name: str, prom: Prometheus, autoscaling: dict[str, Any]
) -> None:
    """kubectl apply of a tiny Qwen-Image pipeline whose denoise stage autoscales."""
    manifest = yaml.safe_dump(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": name},
            "spec": {
                "model": "tiny://qwen-image",
                "pipeline": "qwen-image",
                "prometheusUrl": prom.url,
                "stages": [{"name": "denoise", "autoscaling": autoscaling}],
            },
        }
    )
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest)


def replicas(cluster: Cluster, namespace: str, name: str, stage: str = "denoise") -> int | None:
    """The stage Deployment's spec.replicas; None while the operator has not created it.
    Found by its labels: its name carries the pipeline's revision."""
    proc = cluster.kubectl(
        "get",
        "deployment",
        "-l",
        f"omnipipe.io/pipeline={name},omnipipe.io/stage={stage}",
        "-n",
        namespace,
        "-o",
        "jsonpath={.items[*].spec.replicas}",
        check=False,
    )
    counts = proc.stdout.split() if proc.returncode == 0 else []
    assert len(counts) <= 1, f"one revision expected, found {len(counts)} {stage} Deployments"
    return int(counts[0]) if counts else None


def stage_status(
    cluster: Cluster, namespace: str, name: str, stage: str = "denoise"
) -> dict[str, Any]:
    status = get_json(cluster, "omnip", name, "-n", namespace).get("status", {})
    return next((s for s in status.get("stages", []) if s["name"] == stage), {})


def condition(cluster: Cluster, namespace: str, name: str, kind: str) -> dict[str, Any]:
    status = get_json(cluster, "omnip", name, "-n", namespace).get("status", {})
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def scaled_events(cluster: Cluster, namespace: str) -> str:
    """The messages of the autoscaler's Scaled events in a namespace."""
    return cluster.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        "reason=Scaled",
        "-o",
        "jsonpath={.items[*].message}",
    ).stdout


class Clients:
    """`count` openai clients of the local workers, each sending `call`'s request again
    and again until stopped."""

    def __init__(self, served: Served, count: int, call: Callable[[openai.OpenAI], object]) -> None:
        self.stop = threading.Event()
        self.call = call
        self.threads = [threading.Thread(target=self._run, args=(served,)) for _ in range(count)]

    def _run(self, served: Served) -> None:
        with openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0, timeout=120) as c:
            while not self.stop.is_set():
                self.call(c)

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        # Demand stays high until here: the scale-down window counts from no earlier.
        self.stopped_at = time.monotonic()
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def _denoise_bound_image(c: openai.OpenAI) -> object:
    return c.images.generate(
        model="scaled",
        prompt="load",
        # Denoise-bound, so that requests queue at denoise: at 256x256 the decode took as
        # long as 30 steps, and once every worker had its own thread budget, requests
        # waited at decode instead.
        size="64x64",
        extra_body={"num_inference_steps": 150},
    )


class Load(Clients):
    """Concurrent image requests against the local workers until stopped."""

    def __init__(self, served: Served, concurrency: int) -> None:
        super().__init__(served, concurrency, _denoise_bound_image)


def test_scales_up_under_load_and_down_after_the_window(
    cluster: Cluster, operator: Operator, namespace: str, prom: Prometheus, workers: Served
) -> None:
    denoise_url = workers.workers["denoise-0"][0].removeprefix("http://")
    prom.set_targets([{"targets": [denoise_url], "labels": {"namespace": namespace}}])
    apply_pipeline(
        cluster,
        namespace,
        "scaled",
        prom,
        {
            "minReplicas": 1,
            "maxReplicas": 4,
            "target": 0.5,  # 4 clients keep >= 3 requests in flight: above 4 x 0.5
            "maxStep": 2,
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": 5,
        },
    )
    wait_for(
        "the denoise Deployment",
        lambda: replicas(cluster, namespace, "scaled") is not None,
    )
    wait_for(
        "fresh idle data",
        lambda: (
            stage_status(cluster, namespace, "scaled").get("lastDecisionReason")
            == "WithinTolerance"
        ),
        timeout=60,
    )
    assert replicas(cluster, namespace, "scaled") == 1

    with Load(workers, concurrency=4) as load:
        wait_for("scale-up", lambda: (replicas(cluster, namespace, "scaled") or 0) >= 3, timeout=60)
    st = stage_status(cluster, namespace, "scaled")
    assert st["metric"] == "inflight"
    assert "metricValue" in st
    assert st["lastScaleTime"]
    events = scaled_events(cluster, namespace)
    # e.g. "stage denoise: 1 -> 3 replicas (ScaleUp): signal 4 total, target 1: ..."
    ups = re.findall(r"\(ScaleUp\): signal ([0-9.]+) total", events)
    assert ups, events
    # Above target x (1 + tolerance) for the one ready replica: 0.5 x 1.1.
    assert float(ups[0]) > 0.55
    wait_for(
        "scale-down to the minimum", lambda: replicas(cluster, namespace, "scaled") == 1, timeout=90
    )
    # Not before the 5 s scale-down window allowed it.
    assert time.monotonic() - load.stopped_at >= 5
    assert (
        "ScaleDown"
        in cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "reason=Scaled"
        ).stdout
    )
    assert condition(cluster, namespace, "scaled", "ScalingActive")["status"] == "True"
    described = cluster.kubectl("describe", "omnip", "scaled", "-n", namespace).stdout
    assert "Scaled" in described


def test_wobble_inside_tolerance_changes_nothing(
    cluster: Cluster, operator: Operator, namespace: str, prom: Prometheus
) -> None:
    # A signal that keeps moving, always within 5% of the target (tolerance 10%).
    apply_pipeline(
        cluster,
        namespace,
        "wobble",
        prom,
        {
            "minReplicas": 2,
            "maxReplicas": 6,
            "metric": "promql",
            "query": "1 + 0.05 * sin(vector(time() * 2))",
            "target": 1,
            "tolerance": 0.1,
            "scaleDownStabilizationSeconds": 0,
        },
    )
    wait_for(
        "the minimum of 2",
        lambda: replicas(cluster, namespace, "wobble") == 2,
        timeout=60,
    )
    wait_for(
        "an in-band decision at 2 replicas",
        lambda: (
            stage_status(cluster, namespace, "wobble").get("lastDecisionReason")
            == "WithinTolerance"
        ),
    )
    values = set()
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        st = stage_status(cluster, namespace, "wobble")
        if "metricValue" in st:
            values.add(round(st["metricValue"], 4))
            assert st["lastDecisionReason"] == "WithinTolerance", st
        assert replicas(cluster, namespace, "wobble") == 2
        time.sleep(0.5)
    assert len(values) >= 3, f"the signal did not move: {values}"


def test_prometheus_down_holds_replicas_and_sets_the_condition(
    cluster: Cluster, operator: Operator, namespace: str, tmp_path: Path
) -> None:
    # Its own Prometheus: stopping the module's would break the tests after this one.
    with prometheus(tmp_path / "prom") as prom:
        apply_pipeline(
            cluster,
            namespace,
            "held",
            prom,
            {
                "minReplicas": 1,
                "maxReplicas": 6,
                "metric": "promql",
                "query": "vector(5)",
                "target": 1,
            },
        )
        wait_for(
            "scaling to 5",
            lambda: replicas(cluster, namespace, "held") == 5,
            timeout=60,
        )
        prom.stop()
        wait_for(
            "ScalingActive=False",
            lambda: condition(cluster, namespace, "held", "ScalingActive").get("status") == "False",
            timeout=30,
        )
        cond = condition(cluster, namespace, "held", "ScalingActive")
        assert cond["reason"] == "PrometheusUnavailable"
        assert "unreachable" in cond["message"]
        time.sleep(3)
        assert replicas(cluster, namespace, "held") == 5
        warnings = cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "reason=ScalingHeld"
        ).stdout
        assert "PrometheusUnavailable" in warnings


def test_scale_to_zero_and_wake_on_router_demand(
    cluster: Cluster,
    operator: Operator,
    namespace: str,
    prom: Prometheus,
    tmp_path: Path,
) -> None:
    """A router whose stage has no ready replica holds the request and exports the
    demand; the operator reads it from Prometheus and wakes the scaled-to-zero stage."""
    import json as jsonlib
    import subprocess
    import sys
    import urllib.request

    from omnipipe.local.ports import free_port

    manifest = write_pipeline(tmp_path, "sleepy", transfer="tcp")
    replicas_file = tmp_path / "replicas.json"
    replicas_file.write_text(jsonlib.dumps({"encode": [], "denoise": [], "decode": []}))
    port = free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omnipipe.cli",
            "router",
            "--pipeline",
            str(manifest),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--replicas-file",
            str(replicas_file),
        ],
        env={**cluster.env(), "OMNIPIPE_ROUTER_WAKE_WAIT_SECONDS": "20"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert router.poll() is None, "the router exited"
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=1) as resp:
                    return bool(resp.status == 200)
            except OSError:
                return False

        wait_for("the router", healthy)
        prom.set_targets([{"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": namespace}}])
        # The stage's own signal says "idle" (promql 0): it goes to zero and stays there
        # until the router reports demand.
        cluster.kubectl(
            "apply",
            "-n",
            namespace,
            "-f",
            "-",
            input=yaml.safe_dump(
                {
                    "apiVersion": "omnipipe.io/v1alpha1",
                    "kind": "OmniPipeline",
                    "metadata": {"name": "sleepy"},
                    "spec": {
                        "model": "tiny://qwen-image",
                        "pipeline": "qwen-image",
                        "prometheusUrl": prom.url,
                        "stages": [
                            {
                                "name": "encode",
                                "autoscaling": {
                                    "minReplicas": 0,
                                    "maxReplicas": 2,
                                    "metric": "promql",
                                    "query": "vector(0)",
                                    "target": 1,
                                    "scaleDownStabilizationSeconds": 0,
                                },
                            }
                        ],
                    },
                }
            ),
        )

        wait_for(
            "scale to zero",
            lambda: replicas(cluster, namespace, "sleepy", "encode") == 0,
            timeout=60,
        )
        wait_for(
            "ScaledToZero",
            lambda: (
                stage_status(cluster, namespace, "sleepy", "encode").get("lastDecisionReason")
                == "ScaledToZero"
            ),
        )
        # Asleep, the model is still listed.
        with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60) as c:
            assert [m.id for m in c.models.list()] == ["sleepy"]
            outcome: list[BaseException] = []

            def request() -> None:
                try:
                    c.images.generate(model="sleepy", prompt="wake up", size="32x32")
                except BaseException as exc:
                    outcome.append(exc)

            t = threading.Thread(target=request)
            t.start()
            wait_for(
                "a wake-up",
                lambda: "(WakeOnDemand)" in scaled_events(cluster, namespace),
                timeout=30,
            )
            t.join(timeout=60)
        # No worker exists in this test, so after the bounded wait: 503 with Retry-After.
        assert outcome, "the held request never ended"
        assert isinstance(outcome[0], openai.APIStatusError)
        assert outcome[0].status_code == 503
        assert outcome[0].response.headers["retry-after"] == "5"
    finally:
        router.terminate()
        router.wait(timeout=20)
