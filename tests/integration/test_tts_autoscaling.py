"""Autoscaling a TTS talker on its time to first audio, end to end: the talker (omnipipe
serve of a tiny Qwen3-TTS) times each request's first codes, a real Prometheus scrapes
it, and the operator scales the talker's Deployment in the real API server on
first-audio-p90 while code2wav keeps its own count."""

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
NAME = "tts-scaled"
MODEL = "tiny://qwen3-tts-custom-voice"


def manifest(prometheus_url: str | None = None, talker: dict[str, object] | None = None) -> str:
    spec: dict[str, object] = {
        "model": MODEL,
        "pipeline": "qwen3-tts",
        "transfer": {"backend": "tcp"},
        "stages": [{"name": "talker", **(talker or {})}],
    }
    if prometheus_url is not None:
        spec["prometheusUrl"] = prometheus_url
    return pipeline_yaml(NAME, spec)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("tts"), NAME, manifest()) as s:
        yield s


def speak(c: openai.OpenAI) -> object:
    return c.audio.speech.create(
        model=NAME,
        input="The train leaves at noon.",
        voice="vivian",
        response_format="pcm",
        extra_body={"max_new_tokens": 20},
    )


def test_the_autoscaler_scales_a_talker_on_its_time_to_first_audio(
    cluster: Cluster, operator: Operator, namespace: str, prom: Prometheus, served: Served
) -> None:
    url = served.workers["talker-0"][0].removeprefix("http://")
    prom.set_targets([{"targets": [url], "labels": {"namespace": namespace}}])
    count = (
        "omnipipe_stage_time_to_first_audio_seconds_count"
        f'{{namespace="{namespace}",pipeline="{NAME}",stage="talker"}}'
    )
    wait_for("Prometheus to scrape the talker", lambda: bool(prom.query(count)), timeout=60)
    assert float(prom.query(count)[0]["value"][1]) == 0.0  # no request yet

    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "metric": "first-audio-p90",
        # A tiny talker's first codes come in tenths of a second: every one is late.
        "target": 0.001,
        "maxStep": 2,
        "scaleUpStabilizationSeconds": 0,
    }
    body = manifest(prom.url, {"autoscaling": autoscaling})
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=body)
    wait_for(
        "the talker Deployment", lambda: replicas(cluster, namespace, NAME, "talker") is not None
    )
    assert replicas(cluster, namespace, NAME, "talker") == 1

    with Clients(served, 2, speak):
        wait_for(
            "the talker to time first audio",
            lambda: any(float(r["value"][1]) > 0 for r in prom.query(count)),
            timeout=90,
        )
        wait_for(
            "scale-up on first-audio-p90",
            lambda: (replicas(cluster, namespace, NAME, "talker") or 0) >= 2,
            timeout=90,
        )
    st = stage_status(cluster, namespace, NAME, "talker")
    assert st["metric"] == "first-audio-p90"
    assert st["metricValue"] > 0.001
    # code2wav is not autoscaled: it keeps the one replica its type gives it.
    assert replicas(cluster, namespace, NAME, "code2wav") == 1
