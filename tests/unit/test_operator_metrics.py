"""The operator's per-pipeline series follow the status: replicas, maxReplicas of
autoscaled stages, a failing fetch and a stall, each gone when it no longer holds, and
all of a deleted pipeline's gone with it (an alert must not fire on what is gone)."""

from __future__ import annotations

from omnipipe.api.status import Condition, ConditionStatus, OmniPipelineStatus, StageStatus
from omnipipe.operator.metrics import OperatorMetrics


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
