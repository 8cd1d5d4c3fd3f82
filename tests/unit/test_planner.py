from __future__ import annotations

from dataclasses import replace
from typing import Any

from omnipipe.api import parse_resource, resolve
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.status import ConditionStatus
from omnipipe.operator.planner import (
    ObservedDeployment,
    initial_replicas,
    orphans,
    plan_rollout,
    revision_children,
)
from omnipipe.operator.status_rollup import compute_status

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
REV = pipeline_revision(PIPELINE)
ALL = (f"p-encode-{REV}", f"p-denoise-{REV}", f"p-decode-{REV}", "p-router")


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
    del deps[f"p-denoise-{REV}"]
    deps[f"p-decode-{REV}"] = ObservedDeployment(
        desired=2, replicas=2, ready=0, updated=2, up_to_date=True
    )
    status, c = conditions(deps)
    assert c["StageDenoiseReady"].reason == "Missing"
    assert c["StageDecodeReady"].status is ConditionStatus.FALSE
    assert c["StageDecodeReady"].reason == "ReplicasNotReady"
    assert c["StageDecodeReady"].message == "0/2 replicas ready"
    assert c["Ready"].status is ConditionStatus.FALSE
    assert c["Ready"].reason == "StagesNotReady"
    assert "denoise" in c["Ready"].message
    assert status.stages_ready == "1/3"


def test_a_router_rolling_out_serves_and_one_with_no_ready_pod_does_not() -> None:
    deps = dict.fromkeys(ALL, READY)
    # Its old pod serves while the new one starts.
    deps["p-router"] = ObservedDeployment(
        desired=1, replicas=1, ready=1, updated=1, up_to_date=False
    )
    _, c = conditions(deps)
    assert (c["RouterReady"].status, c["RouterReady"].reason) == (
        ConditionStatus.TRUE,
        "RollingOut",
    )
    assert c["Ready"].status is ConditionStatus.TRUE
    deps["p-router"] = ObservedDeployment(
        desired=2, replicas=2, ready=1, updated=2, up_to_date=True
    )
    _, c = conditions(deps)
    assert (c["RouterReady"].status, c["RouterReady"].reason) == (
        ConditionStatus.TRUE,
        "PartiallyReady",
    )
    deps["p-router"] = ObservedDeployment(
        desired=1, replicas=1, ready=0, updated=1, up_to_date=True
    )
    _, c = conditions(deps)
    assert c["RouterReady"].status is ConditionStatus.FALSE
    assert c["Ready"].reason == "RouterNotReady"


def test_scaled_to_zero_stage_counts_as_ready() -> None:
    deps = dict.fromkeys(ALL, READY)
    deps[f"p-denoise-{REV}"] = ObservedDeployment(
        desired=0, replicas=0, ready=0, updated=0, up_to_date=True
    )
    _, c = conditions(deps)
    assert c["StageDenoiseReady"].reason == "ScaledToZero"
    assert c["Ready"].status is ConditionStatus.TRUE


# ---- Ready means serving: one ready replica serves; capacity is StagesAtCapacity ---------


def with_denoise(**fields: Any) -> dict[str, ObservedDeployment]:
    deps = dict.fromkeys(ALL, READY)
    deps[f"p-denoise-{REV}"] = replace(READY, **fields)
    return deps


def test_a_scale_up_with_one_ready_replica_keeps_the_pipeline_ready() -> None:
    # The autoscaler asked for 2; the Deployment controller has not seen it yet.
    _, asked = conditions(with_denoise(desired=2, up_to_date=False))
    assert (asked["StageDenoiseReady"].status, asked["StageDenoiseReady"].reason) == (
        ConditionStatus.TRUE,
        "RollingOut",
    )
    assert asked["Ready"].status is ConditionStatus.TRUE
    # The second pod exists and starts; the first serves meanwhile.
    status, c = conditions(with_denoise(desired=2, replicas=2, updated=2))
    assert (c["StageDenoiseReady"].status, c["StageDenoiseReady"].reason) == (
        ConditionStatus.TRUE,
        "PartiallyReady",
    )
    assert c["StageDenoiseReady"].message == "1/2 replicas ready"
    assert (c["StagesReady"].status, c["Ready"].status) == (ConditionStatus.TRUE,) * 2
    assert c["Ready"].reason == "Serving"
    assert status.stages_ready == "3/3"
    # What it lacks is capacity, said apart from Ready.
    assert (c["StagesAtCapacity"].status, c["StagesAtCapacity"].reason) == (
        ConditionStatus.FALSE,
        "StageBelowCapacity",
    )
    assert c["StagesAtCapacity"].message == "denoise (1/2 replicas ready)"
    _, done = conditions(with_denoise(desired=2, replicas=2, ready=2, updated=2))
    assert done["StageDenoiseReady"].reason == "Available"
    assert (done["StagesAtCapacity"].status, done["StagesAtCapacity"].reason) == (
        ConditionStatus.TRUE,
        "AllStagesAtCapacity",
    )


def test_a_scale_down_in_progress_keeps_the_pipeline_ready() -> None:
    # 2 -> 1: the spec says 1, the controller has not caught up and both pods still run.
    _, c = conditions(with_denoise(desired=1, replicas=2, ready=2, updated=2, up_to_date=False))
    assert (c["StageDenoiseReady"].status, c["StageDenoiseReady"].reason) == (
        ConditionStatus.TRUE,
        "RollingOut",
    )
    assert c["Ready"].status is ConditionStatus.TRUE
    assert c["StagesAtCapacity"].status is ConditionStatus.FALSE
    _, settled = conditions(with_denoise(desired=1, replicas=1, ready=1, updated=1))
    assert settled["StagesAtCapacity"].status is ConditionStatus.TRUE


def test_a_crash_looping_pod_beside_a_serving_one_leaves_ready_alone() -> None:
    status, _ = conditions(with_denoise(desired=2, replicas=2, ready=2, updated=2), now="t1")
    crashed, c = conditions(
        with_denoise(desired=2, replicas=2, ready=1, updated=2),
        previous=status.conditions,
        now="t2",
    )
    assert (c["Ready"].status, c["Ready"].last_transition_time) == (ConditionStatus.TRUE, "t1")
    assert c["StageDenoiseReady"].status is ConditionStatus.TRUE
    assert c["StageDenoiseReady"].reason == "PartiallyReady"
    assert (c["StagesAtCapacity"].status, c["StagesAtCapacity"].last_transition_time) == (
        ConditionStatus.FALSE,
        "t2",
    )
    # The operator owns StagesAtCapacity: a refresh replaces it, never passes it through.
    types = [cond.type for cond in crashed.conditions]
    assert len(types) == len(set(types))


def test_a_stage_with_no_ready_replica_is_not_ready() -> None:
    for state in (
        {"desired": 1, "ready": 0},
        {"desired": 2, "replicas": 2, "updated": 2, "ready": 0},
        {"desired": 2, "replicas": 1, "ready": 0, "up_to_date": False},
    ):
        _, c = conditions(with_denoise(**state))
        assert c["StageDenoiseReady"].status is ConditionStatus.FALSE, state
        assert (c["StagesReady"].status, c["Ready"].status) == (ConditionStatus.FALSE,) * 2
        assert c["Ready"].reason == "StagesNotReady"
        assert c["StagesAtCapacity"].status is ConditionStatus.FALSE


def test_a_stage_scaled_to_zero_is_ready_and_at_capacity_and_waking_is_not_ready() -> None:
    # Asleep (or on the way there with a pod still up): it wakes on demand.
    for ready in (0, 1):
        _, c = conditions(with_denoise(desired=0, replicas=ready, ready=ready, updated=0))
        assert (c["StageDenoiseReady"].status, c["StageDenoiseReady"].reason) == (
            ConditionStatus.TRUE,
            "ScaledToZero",
        )
        assert c["Ready"].status is ConditionStatus.TRUE
        assert c["StagesAtCapacity"].status is ConditionStatus.TRUE
    # Woken: asked for 1, none ready yet; no replica serves until it is.
    _, waking = conditions(with_denoise(desired=1, replicas=1, ready=0))
    assert waking["StageDenoiseReady"].status is ConditionStatus.FALSE
    assert waking["Ready"].status is ConditionStatus.FALSE


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


# ---- revisions: a compatibility change rolls out as a whole new set of stages ----------

STAGES = ("encode", "denoise", "decode")


def _pipeline(model: str) -> Any:
    return resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "p"},
                "spec": {
                    "model": model,
                    "pipeline": "qwen-image",
                    "stages": [{"name": "denoise", "autoscaling": {"maxReplicas": 8}}],
                },
            }
        )
    )


def _revision(revision: str, ready: bool = True, desired: int = 1) -> list[ObservedDeployment]:
    state = replace(READY, desired=desired, replicas=desired, ready=desired, updated=desired)
    if not ready:
        state = replace(state, ready=0)
    return [replace(state, stage=s, revision=revision) for s in STAGES]


def test_a_new_revision_serves_only_once_all_its_stages_are_ready() -> None:
    old, new = _pipeline("m1"), _pipeline("m2")
    r_old, r_new = pipeline_revision(old), pipeline_revision(new)
    assert r_old != r_new
    half = [*_revision(r_new)[:2], _revision(r_new, ready=False)[2]]
    rollout = plan_rollout(new, r_old, _revision(r_old) + half)
    assert (rollout.current, rollout.update, rollout.retire) == (r_old, r_new, ())
    assert rollout.progressing
    assert rollout.ready_count(r_new) == (2, 3)
    status = compute_status(new, 2, {}, [], "e", "t", rollout=rollout)
    conds = {c.type: c for c in status.conditions}
    assert conds["Progressing"].status is ConditionStatus.TRUE
    assert conds["Progressing"].reason == "RollingOut"
    assert (status.current_revision, status.update_revision) == (r_old, r_new)
    assert [(r.revision, r.stages_ready, r.ready) for r in status.revisions] == [
        (r_new, "2/3", False),
        (r_old, "3/3", True),
    ]

    done = plan_rollout(new, r_old, _revision(r_old) + _revision(r_new))
    assert (done.current, done.retire, done.progressing) == (r_new, (r_old,), False)
    status = compute_status(new, 2, {}, [], "e", "t", rollout=done)
    conds = {c.type: c for c in status.conditions}
    assert (conds["Progressing"].status, conds["Progressing"].reason) == (
        ConditionStatus.FALSE,
        "RolloutComplete",
    )
    assert [r.revision for r in status.revisions] == [r_new]


def test_a_new_revision_takes_over_only_at_full_capacity() -> None:
    """The old revision is retired on the switch, so a new one serving on 1 of the 2
    replicas the load needs would halve capacity: the switch waits for all of them."""
    old, new = _pipeline("m1"), _pipeline("m2")
    r_old, r_new = pipeline_revision(old), pipeline_revision(new)
    partial = [
        replace(d, ready=1) if d.stage == "denoise" else d for d in _revision(r_new, desired=2)
    ]
    rollout = plan_rollout(new, r_old, _revision(r_old, desired=2) + partial)
    assert (rollout.current, rollout.retire) == (r_old, ())
    assert rollout.ready_count(r_new) == (2, 3)
    full = plan_rollout(new, r_old, _revision(r_old, desired=2) + _revision(r_new, desired=2))
    assert (full.current, full.retire) == (r_new, (r_old,))


def test_a_revision_superseded_before_it_served_is_retired_at_once() -> None:
    a, b, c = (pipeline_revision(_pipeline(m)) for m in ("m1", "m2", "m3"))
    rollout = plan_rollout(
        _pipeline("m3"), a, _revision(a) + _revision(b, ready=False) + _revision(c, ready=False)
    )
    assert (rollout.current, rollout.update, rollout.retire) == (a, c, (b,))


def test_rolling_back_to_the_serving_revision_retires_the_new_one() -> None:
    a, b = (pipeline_revision(_pipeline(m)) for m in ("m1", "m2"))
    rollout = plan_rollout(_pipeline("m1"), a, _revision(a) + _revision(b, ready=False))
    assert (rollout.current, rollout.update, rollout.retire, rollout.progressing) == (
        a,
        a,
        (b,),
        False,
    )


def test_a_first_revision_serves_at_once_and_a_lost_current_is_replaced() -> None:
    new = _pipeline("m2")
    r_new = pipeline_revision(new)
    assert plan_rollout(new, None, []).current == r_new
    assert plan_rollout(new, "gone", _revision(r_new, ready=False)).current == r_new


def test_autoscaled_stages_of_a_new_revision_start_at_the_serving_count() -> None:
    old, new = _pipeline("m1"), _pipeline("m2")
    r_old, r_new = pipeline_revision(old), pipeline_revision(new)
    rollout = plan_rollout(new, r_old, _revision(r_old, desired=5))
    created = [f"p-{s}-{r_new}" for s in STAGES]
    # Only denoise autoscales; the others have their fixed count in the manifest.
    assert initial_replicas(new, rollout, created) == {f"p-denoise-{r_new}": 5}
    # Not for a Deployment that already existed, nor without a rollout.
    assert initial_replicas(new, rollout, []) == {}
    steady = plan_rollout(new, r_new, _revision(r_new))
    assert initial_replicas(new, steady, created) == {}


def test_children_of_other_revisions_are_the_rollouts_not_orphans() -> None:
    def child(kind: str, name: str, revision: str | None) -> dict[str, Any]:
        labels = {"omnipipe.io/revision": revision} if revision else {}
        return {"kind": kind, "metadata": {"name": name, "labels": labels}}

    existing = {
        (k, n): child(k, n, r)
        for k, n, r in (
            ("Deployment", "p-a-new", "new"),
            ("Deployment", "p-gone-new", "new"),
            ("Deployment", "p-a-old", "old"),
            ("ConfigMap", "p-config-old", "old"),
            ("Service", "p-a", None),
            ("Service", "p-gone", None),
        )
    }
    desired = [("Deployment", "p-a-new"), ("Service", "p-a")]
    assert orphans(existing, desired, "new") == [
        ("Deployment", "p-gone-new"),
        ("Service", "p-gone"),
    ]
    assert revision_children(existing, ["old"]) == [
        ("ConfigMap", "p-config-old"),
        ("Deployment", "p-a-old"),
    ]


def test_deployments_from_before_revisions_serve_until_the_first_revision_is_ready() -> None:
    """An upgrade: `p-<stage>` Deployments and `p-config` without a revision label are
    the serving (legacy) revision, not orphans, and are retired only after the switch."""
    new = _pipeline("m1")
    r_new = pipeline_revision(new)

    def legacy_manifest(stage: str) -> dict[str, Any]:
        return {
            "kind": "Deployment",
            "metadata": {
                "name": f"p-{stage}",
                "generation": 1,
                "labels": {"omnipipe.io/pipeline": "p", "omnipipe.io/stage": stage},
            },
            "spec": {"replicas": 2},
            "status": {
                "replicas": 2,
                "readyReplicas": 2,
                "updatedReplicas": 2,
                "availableReplicas": 2,
                "observedGeneration": 1,
            },
        }

    legacy = [ObservedDeployment.from_manifest(legacy_manifest(s)) for s in STAGES]
    assert {d.revision for d in legacy} == {"legacy"}
    # An older operator wrote no currentRevision.
    starting = plan_rollout(new, None, legacy + _revision(r_new, ready=False))
    assert (starting.current, starting.update, starting.retire) == ("legacy", r_new, ())
    assert starting.progressing
    status = compute_status(
        new,
        2,
        {f"p-{s}": d for s, d in zip(STAGES, legacy, strict=True)},
        [],
        "e",
        "t",
        rollout=starting,
    )
    conds = {c.type: c for c in status.conditions}
    # The legacy Deployments are what serves: the pipeline stays Ready meanwhile.
    assert conds["StagesReady"].status is ConditionStatus.TRUE
    assert status.current_revision == "legacy"

    existing = {("Deployment", f"p-{s}"): legacy_manifest(s) for s in STAGES}
    existing[("ConfigMap", "p-config")] = {
        "kind": "ConfigMap",
        "metadata": {"name": "p-config", "labels": {"app.kubernetes.io/component": "config"}},
    }
    existing[("Service", "p-gone")] = {"kind": "Service", "metadata": {"name": "p-gone"}}
    desired = [("Deployment", f"p-{s}-{r_new}") for s in STAGES]
    assert orphans(existing, desired, r_new) == [("Service", "p-gone")]

    switched = plan_rollout(new, "legacy", legacy + _revision(r_new))
    assert (switched.current, switched.retire) == (r_new, ("legacy",))
    assert revision_children(existing, switched.retire) == [
        ("ConfigMap", "p-config"),
        *[("Deployment", f"p-{s}") for s in sorted(STAGES)],
    ]
