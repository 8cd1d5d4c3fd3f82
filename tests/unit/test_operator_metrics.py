"""The operator's per-pipeline series follow the status: replicas, maxReplicas of
autoscaled stages, a failing fetch and a stall, each gone when it no longer holds, and
all of a deleted pipeline's gone with it (an alert must not fire on what is gone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import yaml

from omnipipe.api import parse_resource
from omnipipe.api.status import Condition, ConditionStatus, OmniPipelineStatus, StageStatus
from omnipipe.operator.builders import build_children, build_context
from omnipipe.operator.k8s import Kube
from omnipipe.operator.metrics import OperatorMetrics
from omnipipe.operator.reconcile import refresh_status
from omnipipe.operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]


def status(*conditions: tuple[str, ConditionStatus, str], stages: int = 2) -> OmniPipelineStatus:
    return OmniPipelineStatus(
        conditions=[Condition(type=t, status=s, reason=r) for t, s, r in conditions],
        stages=[
            StageStatus(name=n, desired_replicas=2, ready_replicas=1)
            for n in ("encode", "denoise")[:stages]
        ],
    )


def value(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_series_follow_the_status_and_go_with_the_pipeline() -> None:
    m = OperatorMetrics.create()
    failing = ("ModelCached", ConditionStatus.FALSE, "NoSpace")
    stalled = ("Stalled", ConditionStatus.TRUE, "FetchFailed")
    m.observe_status("ns", "p", status(failing, stalled), {"denoise": 6})
    stage = {"namespace": "ns", "pipeline": "p", "stage": "denoise"}
    assert value(m, "omnipipe_stage_replicas_desired", **stage) == 2
    assert value(m, "omnipipe_stage_replicas_max", **stage) == 6
    assert value(m, "omnipipe_stage_replicas_max", **{**stage, "stage": "encode"}) is None
    pipeline = {"namespace": "ns", "pipeline": "p"}
    assert value(m, "omnipipe_weights_fetch_failing", **pipeline, reason="NoSpace") == 1
    assert value(m, "omnipipe_pipeline_stalled", **pipeline, reason="FetchFailed") == 1

    # Fetching again (a retry), not stalled, one stage fewer: those series go.
    m.observe_status(
        "ns", "p", status(("ModelCached", ConditionStatus.FALSE, "Fetching"), stages=1), {}
    )
    assert value(m, "omnipipe_weights_fetch_failing", **pipeline, reason="NoSpace") is None
    assert value(m, "omnipipe_pipeline_stalled", **pipeline, reason="FetchFailed") is None
    assert value(m, "omnipipe_stage_replicas_desired", **stage) is None
    assert value(m, "omnipipe_stage_replicas_max", **stage) is None
    encode = {**stage, "stage": "encode"}
    assert value(m, "omnipipe_stage_replicas_ready", **encode) == 1

    m.observe_status("ns", "other", status(), {})
    m.forget("ns", "p")
    assert value(m, "omnipipe_stage_replicas_ready", **encode) is None
    assert value(m, "omnipipe_stage_replicas_ready", **{**encode, "pipeline": "other"}) == 1


class StatusKube:
    """The reads refresh_status makes, of one pipeline whose children all run; each status
    patch records what /metrics said the moment it went out."""

    def __init__(self, body: dict[str, Any], deployments: list[dict[str, Any]]) -> None:
        self.body, self.deployments = body, deployments
        self.metrics = OperatorMetrics.create()
        self.patched: list[tuple[dict[str, Any], float | None]] = []

    async def get_pipeline(self, namespace: str, name: str) -> dict[str, Any]:
        return self.body

    async def list_deployments(self, namespace: str, pipeline: str) -> list[dict[str, Any]]:
        return self.deployments

    async def list_pods(self, namespace: str, pipeline: str) -> list[dict[str, Any]]:
        return []

    async def post_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        denoise = {"namespace": namespace, "pipeline": name, "stage": "denoise"}
        scraped = value(self.metrics, "omnipipe_stage_replicas_ready", **denoise)
        self.patched.append((status, scraped))


def running(deployment: dict[str, Any]) -> dict[str, Any]:
    """A Deployment as its controller reports it once every replica is ready."""
    replicas = deployment["spec"].get("replicas", 1)
    return {
        **deployment,
        "metadata": {**deployment["metadata"], "generation": 1},
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "readyReplicas": replicas,
            "updatedReplicas": replicas,
        },
    }


async def test_a_status_is_never_visible_before_its_series() -> None:
    """/metrics is served from its own thread while the status patch is awaited: a reader
    who sees the pipeline Ready must scrape its ready replicas too, not the counts before."""
    body = yaml.safe_load((REPO / "examples/qwen-image.yaml").read_text())
    body["metadata"].update(namespace="ns", uid="u1", generation=1)
    settings = OperatorSettings()
    built = build_children(build_context(parse_resource(body), settings))
    kube = StatusKube(body, [running(d) for d in built if d["kind"] == "Deployment"])

    await refresh_status(cast(Kube, kube), settings, "ns", "qwen-image", kube.metrics)

    [(patch, scraped)] = kube.patched
    assert [c["status"] for c in patch["conditions"] if c["type"] == "Ready"] == ["True"]
    assert scraped == 1, f"the Ready status went out while /metrics said {scraped!r}"
