from __future__ import annotations

from dataclasses import replace
from typing import Any

from omnipipe.api import parse_resource, resolve
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.status import ConditionStatus
from omnipipe.operator.planner import (
    ObservedDeployment,
    compute_status,
    initial_replicas,
    orphans,
    plan_rollout,
    revision_children,
)

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
    deps[f"p-denoise-{REV}"] = ObservedDeployment(
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
    state = replace(READY, desired=desired, replicas=desired, updated=desired)
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
