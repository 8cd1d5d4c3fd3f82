from __future__ import annotations

from omnipipe.api import parse_resource, resolve
from omnipipe.api.status import ConditionStatus
from omnipipe.operator.planner import ObservedDeployment, compute_status, orphans

PIPELINE = resolve(
    parse_resource(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": "p"},
            "spec": {"model": "m", "pipeline": "qwen-image"},
        }
    )
)
READY = ObservedDeployment(desired=1, replicas=1, ready=1, updated=1, up_to_date=True)
ALL = ("p-encode", "p-denoise", "p-decode", "p-router")


def conditions(deployments: dict[str, ObservedDeployment], previous=(), now="t1"):  # type: ignore[no-untyped-def]
    status = compute_status(PIPELINE, 3, deployments, previous, "http://e/v1", now)
    return status, {c.type: c for c in status.conditions}


def test_ready_when_every_child_is_ready() -> None:
    status, c = conditions(dict.fromkeys(ALL, READY))
    assert c["Ready"].status is ConditionStatus.TRUE
    assert c["Ready"].reason == "Serving"
    assert status.stages_ready == "3/3"
    assert status.observed_generation == 3
    assert {c["StageEncodeReady"].status, c["StagesReady"].status, c["RouterReady"].status} == {
        ConditionStatus.TRUE
    }


def test_missing_and_unready_stages_roll_up() -> None:
    deps = dict.fromkeys(ALL, READY)
    del deps["p-denoise"]
    deps["p-decode"] = ObservedDeployment(
        desired=2, replicas=2, ready=1, updated=2, up_to_date=True
    )
    status, c = conditions(deps)
    assert c["StageDenoiseReady"].reason == "Missing"
    assert c["StageDecodeReady"].reason == "ReplicasNotReady"
    assert c["StageDecodeReady"].message == "1/2 replicas ready"
    assert c["Ready"].status is ConditionStatus.FALSE
    assert c["Ready"].reason == "StagesNotReady"
    assert "denoise" in c["Ready"].message
    assert status.stages_ready == "1/3"


def test_router_not_ready_and_rollout_in_progress() -> None:
    deps = dict.fromkeys(ALL, READY)
    deps["p-router"] = ObservedDeployment(
        desired=1, replicas=1, ready=1, updated=1, up_to_date=False
    )
    _, c = conditions(deps)
    assert c["RouterReady"].reason == "RollingOut"
    assert c["Ready"].reason == "RouterNotReady"


def test_scaled_to_zero_stage_counts_as_ready() -> None:
    deps = dict.fromkeys(ALL, READY)
    deps["p-denoise"] = ObservedDeployment(
        desired=0, replicas=0, ready=0, updated=0, up_to_date=True
    )
    _, c = conditions(deps)
    assert c["StageDenoiseReady"].reason == "ScaledToZero"
    assert c["Ready"].status is ConditionStatus.TRUE


def test_transition_time_kept_until_status_changes() -> None:
    status, _ = conditions(dict.fromkeys(ALL, READY), now="t1")
    _, same = conditions(dict.fromkeys(ALL, READY), previous=status.conditions, now="t2")
    assert same["Ready"].last_transition_time == "t1"
    _, flipped = conditions({}, previous=status.conditions, now="t3")
    assert flipped["Ready"].last_transition_time == "t3"


def test_observed_deployment_from_manifest() -> None:
    obs = ObservedDeployment.from_manifest(
        {
            "metadata": {"generation": 4},
            "spec": {"replicas": 3},
            "status": {
                "observedGeneration": 3,
                "replicas": 3,
                "readyReplicas": 2,
                "updatedReplicas": 1,
            },
        }
    )
    assert obs == ObservedDeployment(desired=3, replicas=3, ready=2, updated=1, up_to_date=False)


def test_orphans_are_what_is_no_longer_desired() -> None:
    existing = [("Deployment", "p-a"), ("Service", "p-a"), ("Deployment", "p-b")]
    assert orphans(existing, [("Deployment", "p-b")]) == [("Deployment", "p-a"), ("Service", "p-a")]
