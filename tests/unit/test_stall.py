"""Reconciling and Stalled, the conditions Flux's kstatus reads: each stall case from a
pod as the kubelet and the scheduler report it, and the cases that must not stall."""

from __future__ import annotations

from typing import Any

import pytest

from omnipipe.api import constants as k
from omnipipe.api import parse_resource, resolve
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.status import ConditionStatus
from omnipipe.operator.planner import ObservedDeployment, plan_rollout
from omnipipe.operator.stall import ObservedPod, StallPolicy
from omnipipe.operator.status_rollup import compute_status
from omnipipe.operator.weights_status import FetchFailure, ObservedFetch, fetch_stall


def _pipeline(spec: dict[str, Any] | None = None) -> Any:
    return resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "p"},
                "spec": {"model": "m", "pipeline": "qwen-image", **(spec or {})},
            }
        )
    )


PIPELINE = _pipeline()
REV = pipeline_revision(PIPELINE)
NOW = "2026-11-24T12:10:00Z"


def deployment(ready: int, desired: int = 1) -> ObservedDeployment:
    return ObservedDeployment(
        desired=desired, replicas=desired, ready=ready, updated=desired, up_to_date=True
    )


def serving() -> dict[str, ObservedDeployment]:
    names = [f"p-{s}-{REV}" for s in ("encode", "denoise", "decode")] + ["p-router"]
    return {n: deployment(1) for n in names}


def pod(
    stage: str = "denoise",
    revision: str = REV,
    waiting: str | None = None,
    restarts: int = 0,
    unschedulable_since: str | None = None,
) -> ObservedPod:
    status: dict[str, Any] = {"phase": "Pending" if unschedulable_since else "Running"}
    if waiting:
        status["containerStatuses"] = [
            {
                "name": "worker",
                "restartCount": restarts,
                "state": {"waiting": {"reason": waiting, "message": "back-off pulling"}},
                "lastState": {
                    "terminated": {"exitCode": 1, "message": "Traceback\nOSError: no model at /m"}
                },
            }
        ]
    if unschedulable_since:
        status["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "lastTransitionTime": unschedulable_since,
                "message": "0/1 nodes are available: 1 Insufficient cpu.",
            }
        ]
    labels = {
        k.LABEL_COMPONENT: k.COMPONENT_STAGE,
        k.LABEL_STAGE: stage,
        k.LABEL_REVISION: revision,
    }
    return ObservedPod.from_manifest(
        {"metadata": {"name": f"p-{stage}-x", "labels": labels}, "status": status}
    )


def conditions(deployments: dict[str, ObservedDeployment], **kw: Any) -> dict[str, Any]:
    status = compute_status(PIPELINE, 4, deployments, [], "http://e/v1", NOW, **kw)
    return {c.type: c for c in status.conditions}


def test_serving_is_neither_reconciling_nor_stalled() -> None:
    c = conditions(serving())
    assert (c["Reconciling"].status, c["Reconciling"].reason) == (
        ConditionStatus.FALSE,
        "Reconciled",
    )
    assert (c["Stalled"].status, c["Stalled"].reason) == (ConditionStatus.FALSE, "NotStalled")
    assert c["Stalled"].observed_generation == 4


def test_a_scale_up_that_cannot_start_leaves_a_serving_pipeline_current() -> None:
    deps = serving()
    deps[f"p-denoise-{REV}"] = deployment(ready=1, desired=3)
    c = conditions(
        deps,
        pods=[pod(waiting="ImagePullBackOff"), pod(unschedulable_since="2026-11-24T12:00:00Z")],
    )
    assert c["Ready"].status is ConditionStatus.TRUE
    assert c["Reconciling"].status is ConditionStatus.FALSE
    assert c["Stalled"].status is ConditionStatus.FALSE
    assert c["StagesAtCapacity"].status is ConditionStatus.FALSE


@pytest.mark.parametrize(
    ("the_pod", "reason", "detail"),
    [
        (pod(waiting="ImagePullBackOff"), "ImagePullFailed", "ImagePullBackOff"),
        (pod(waiting="ErrImageNeverPull"), "ImagePullFailed", "ErrImageNeverPull"),
        (pod(waiting="CrashLoopBackOff", restarts=3), "CrashLooping", "OSError: no model at /m"),
        (pod(waiting="CreateContainerConfigError"), "ContainerConfigFailed", "denoise"),
        (
            pod(unschedulable_since="2026-11-24T12:08:59Z"),
            "Unschedulable",
            "Insufficient cpu",
        ),
    ],
)
def test_a_stage_below_its_minimum_stalls_with_its_pods_reason(
    the_pod: ObservedPod, reason: str, detail: str
) -> None:
    deps = serving()
    deps[f"p-denoise-{REV}"] = deployment(ready=0)
    c = conditions(deps, pods=[the_pod])
    assert (c["Stalled"].status, c["Stalled"].reason) == (ConditionStatus.TRUE, reason)
    assert "stage denoise" in c["Stalled"].message
    assert detail in c["Stalled"].message
    # kstatus takes the first of Reconciling/Stalled that is True: only one may be.
    assert c["Reconciling"].status is ConditionStatus.FALSE
    assert (c["Ready"].status, c["Ready"].reason) == (ConditionStatus.FALSE, reason)


@pytest.mark.parametrize(
    "the_pod",
    [
        pod(waiting="CrashLoopBackOff", restarts=2),  # not past the threshold yet
        pod(waiting="ErrImagePull"),  # a first failure, maybe a registry that blinked
        pod(waiting="ContainerCreating"),
        pod(unschedulable_since="2026-11-24T12:09:30Z"),  # 30 s: a node may yet come
        pod(stage="encode", waiting="ImagePullBackOff"),  # a stage at its minimum
        pod(revision="old", waiting="ImagePullBackOff"),  # another revision's pod
    ],
)
def test_waits_that_may_end_are_reconciling_not_stalled(the_pod: ObservedPod) -> None:
    deps = serving()
    deps[f"p-denoise-{REV}"] = deployment(ready=0)
    c = conditions(deps, pods=[the_pod])
    assert c["Stalled"].status is ConditionStatus.FALSE
    assert (c["Reconciling"].status, c["Reconciling"].reason) == (
        ConditionStatus.TRUE,
        "StageBelowMinimum",
    )
    assert "stage denoise (0/1 ready)" in c["Reconciling"].message


def test_the_policy_sets_the_thresholds() -> None:
    deps = serving()
    deps[f"p-denoise-{REV}"] = deployment(ready=0)
    strict = StallPolicy(crash_loop_restarts=1, unschedulable_seconds=5)
    c = conditions(
        deps,
        pods=[pod(waiting="CrashLoopBackOff", restarts=1)],
        stall_policy=strict,
    )
    assert c["Stalled"].reason == "CrashLooping"


def test_a_missing_router_is_below_its_minimum() -> None:
    deps = serving()
    del deps["p-router"]
    c = conditions(deps)
    assert c["Reconciling"].reason == "StageBelowMinimum"
    assert "router (0/1 ready)" in c["Reconciling"].message


def test_an_autoscaled_stage_counts_against_its_minimum_replicas() -> None:
    scaled = _pipeline(
        {
            "stages": [
                {
                    "name": "denoise",
                    "autoscaling": {"minReplicas": 2, "maxReplicas": 4},
                }
            ]
        }
    )
    rev = pipeline_revision(scaled)
    names = [f"p-{s}-{rev}" for s in ("encode", "denoise", "decode")] + ["p-router"]
    deps = {n: deployment(1) for n in names}
    status = compute_status(scaled, 1, deps, [], "e", NOW)
    c = {x.type: x for x in status.conditions}
    assert c["Reconciling"].reason == "StageBelowMinimum"
    assert "stage denoise (1/2 ready)" in c["Reconciling"].message
    assert c["Ready"].status is ConditionStatus.TRUE


def test_a_rollout_is_reconciling_and_its_stuck_pods_stall_it_while_the_old_one_serves() -> None:
    new = _pipeline({"model": "m2"})
    new_rev = pipeline_revision(new)
    old = [
        ObservedDeployment(1, 1, 1, 1, True, stage=s, revision=REV)
        for s in ("encode", "denoise", "decode")
    ]
    fresh = [
        ObservedDeployment(1, 1, 0, 1, True, stage=s, revision=new_rev)
        for s in ("encode", "denoise", "decode")
    ]
    rollout = plan_rollout(new, REV, old + fresh)
    assert rollout.progressing
    deps = {f"p-{d.stage}-{d.revision}": d for d in old + fresh}
    deps["p-router"] = deployment(1)
    status = compute_status(new, 2, deps, [], "e", NOW, rollout=rollout)
    c = {x.type: x for x in status.conditions}
    assert (c["Reconciling"].status, c["Reconciling"].reason) == (
        ConditionStatus.TRUE,
        "RollingOut",
    )
    assert c["Ready"].status is ConditionStatus.TRUE

    stuck = pod(revision=new_rev, waiting="CrashLoopBackOff", restarts=5)
    status = compute_status(new, 2, deps, [], "e", NOW, rollout=rollout, pods=[stuck])
    c = {x.type: x for x in status.conditions}
    assert (c["Stalled"].status, c["Stalled"].reason) == (ConditionStatus.TRUE, "CrashLooping")
    assert c["Ready"].status is ConditionStatus.TRUE  # the old revision still serves


def test_weights_being_fetched_are_reconciling() -> None:
    fetching = (ConditionStatus.FALSE, "Fetching", "0/1 models cached; fetching m")
    c = conditions({}, model_cached=fetching)
    assert (c["Reconciling"].status, c["Reconciling"].reason) == (
        ConditionStatus.TRUE,
        "FetchingWeights",
    )
    assert c["Stalled"].status is ConditionStatus.FALSE


def _fetch(reason: str, gave_up: bool, attempts: int = 1) -> dict[str, ObservedFetch]:
    return {
        "job": ObservedFetch(
            job="job",
            model="m",
            succeeded=False,
            gave_up=gave_up,
            failed_attempts=attempts,
            last_failure=FetchFailure(reason, "the hub said no"),
        )
    }


def test_a_refused_model_stalls_at_once_and_other_failures_when_the_job_gives_up() -> None:
    expected = [("m", "job")]
    assert fetch_stall(expected, _fetch("UnknownModel", gave_up=False)) == (
        "ModelRefused",
        "fetching m: UnknownModel: the hub said no",
    )
    assert fetch_stall(expected, _fetch("Unreachable", gave_up=False)) is None
    gave_up = fetch_stall(expected, _fetch("NoSpace", gave_up=True, attempts=2))
    assert gave_up is not None
    assert gave_up[0] == "FetchFailed"
    assert "gave up after 2 attempts: NoSpace" in gave_up[1]

    failing = (ConditionStatus.FALSE, "NoSpace", "fetching m failed")
    c = conditions({}, model_cached=failing, fetch_stall=gave_up)
    assert (c["Stalled"].status, c["Stalled"].reason) == (ConditionStatus.TRUE, "FetchFailed")
    assert c["Ready"].reason == "FetchFailed"
    assert c["Reconciling"].status is ConditionStatus.FALSE
