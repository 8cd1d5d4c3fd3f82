"""One stage scaled up on one of its signals, end to end, as the autoscaling tests of the
TTS talker and the vLLM thinker both check it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai

from tests.e2e.conftest import Served
from tests.harness.cluster import Cluster
from tests.harness.prometheus import Prometheus
from tests.integration.conftest import wait_for
from tests.integration.test_autoscaling import Clients, replicas, stage_status


def scales_up_on_signal(
    cluster: Cluster,
    namespace: str,
    prom: Prometheus,
    served: Served,
    *,
    name: str,
    stage: str,
    series: str,
    metric: str,
    target: float,
    manifest: Callable[[dict[str, Any]], str],
    load: Callable[[openai.OpenAI], object],
    clients: int,
) -> dict[str, Any]:
    """Prometheus scrapes the stage's worker of `served`, whose `series` (a selector
    without labels, which this adds) reads 0 while idle; the pipeline `manifest` gives
    for an autoscaling is applied with one replica; under `clients` callers of `load` the
    series rises and the stage's Deployment scales to two or more. The stage's status.
    Autoscaling: on `metric` past `target`, from 1 to 3 replicas, up at once."""
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "metric": metric,
        "target": target,
        "maxStep": 2,
        "scaleUpStabilizationSeconds": 0,
    }
    url = served.workers[f"{stage}-0"][0].removeprefix("http://")
    prom.set_targets([{"targets": [url], "labels": {"namespace": namespace}}])
    query = f'{series}{{namespace="{namespace}",pipeline="{name}",stage="{stage}"}}'
    wait_for(f"Prometheus to scrape {series}", lambda: bool(prom.query(query)), timeout=60)
    assert float(prom.query(query)[0]["value"][1]) == 0.0  # idle
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest(autoscaling))
    wait_for(
        f"the {stage} Deployment", lambda: replicas(cluster, namespace, name, stage) is not None
    )
    assert replicas(cluster, namespace, name, stage) == 1
    with Clients(served, clients, load):
        wait_for(
            f"{series} to rise under load",
            lambda: any(float(r["value"][1]) > 0 for r in prom.query(query)),
            timeout=90,
        )
        wait_for(
            f"scale-up on {metric}",
            lambda: (replicas(cluster, namespace, name, stage) or 0) >= 2,
            timeout=90,
        )
    st: dict[str, Any] = stage_status(cluster, namespace, name, stage)
    assert st["metric"] == metric
    return st
