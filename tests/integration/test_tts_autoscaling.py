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
from tests.integration.conftest import Operator, pipeline_yaml, serving
from tests.integration.scale_up import scales_up_on_signal
from tests.integration.test_autoscaling import replicas

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
    st = scales_up_on_signal(
        cluster,
        namespace,
        prom,
        served,
        name=NAME,
        stage="talker",
        # Its count: 0 before any request, more once the talker has timed a first audio.
        series="omnipipe_stage_time_to_first_audio_seconds_count",
        metric="first-audio-p90",
        # A tiny talker's first codes come in tenths of a second: every one is late.
        target=0.001,
        manifest=lambda a: manifest(prom.url, {"autoscaling": a}),
        load=speak,
        clients=2,
    )
    assert st["metricValue"] > 0.001
    # code2wav is not autoscaled: it keeps the one replica its type gives it.
    assert replicas(cluster, namespace, NAME, "code2wav") == 1
