"""Pure: the observed children rolled up into the OmniPipeline's status and conditions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from omnipipe.api import ResolvedPipeline
from omnipipe.api.names import router_object_name, stage_condition_type, stage_deployment_name
from omnipipe.api.placement import worker_name
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.status import (
    Condition,
    ConditionStatus,
    OmniPipelineStatus,
    RevisionStatus,
    StageStatus,
)
from omnipipe.operator.planner import ObservedDeployment, Rollout, deployment_condition
from omnipipe.operator.stall import DEFAULT_STALL_POLICY, ObservedPod, StallPolicy, progress


def _stage_condition(
    at_capacity: tuple[ConditionStatus, str, str], observed: ObservedDeployment | None
) -> tuple[ConditionStatus, str, str]:
    """Whether a stage (or the router) serves: one ready replica takes requests, so an
    autoscaler scale-up, a rolling update or a crash-looping pod beside a ready one
    leaves the stage ready. What it lacks of its capacity (at_capacity, from
    deployment_condition) shows in the reason and in StagesAtCapacity, never in Ready."""
    status, reason, message = at_capacity
    if status is ConditionStatus.TRUE or observed is None or observed.ready < 1:
        return status, reason, message
    serving_reason = "RollingOut" if reason == "RollingOut" else "PartiallyReady"
    return ConditionStatus.TRUE, serving_reason, message


def condition(
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    previous: Mapping[str, Condition],
    now: str,
    generation: int | None,
) -> Condition:
    before = previous.get(type_)
    since = before.last_transition_time if before and before.status == status else now
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


def _progressing(rollout: Rollout | None) -> tuple[ConditionStatus, str, str]:
    if rollout is None or not rollout.progressing:
        revision = rollout.current if rollout else "the only revision"
        return ConditionStatus.FALSE, "RolloutComplete", f"serving revision {revision}"
    ready, total = rollout.ready_count(rollout.update)
    return (
        ConditionStatus.TRUE,
        "RollingOut",
        f"revision {rollout.update}: {ready}/{total} stages ready; "
        f"revision {rollout.current} serves until all are",
    )


SCALING_FIELDS = (
    "metric",
    "metric_value",
    "last_decision",
    "last_decision_reason",
    "last_scale_time",
)
# ModelCached is the operator's too: it goes when weights.source leaves cache.
OWN_CONDITIONS = (
    "Ready",
    "StagesReady",
    "StagesAtCapacity",
    "RouterReady",
    "Progressing",
    "Reconciling",
    "Stalled",
    "ModelCached",
)


def compute_status(
    pipeline: ResolvedPipeline,
    generation: int | None,
    deployments: Mapping[str, ObservedDeployment],
    previous: Sequence[Condition],
    endpoint: str,
    now: str,
    previous_stages: Sequence[StageStatus] = (),
    rollout: Rollout | None = None,
    model_cached: tuple[ConditionStatus, str, str] | None = None,
    pods: Sequence[ObservedPod] = (),
    fetch_stall: tuple[str, str] | None = None,
    stall_policy: StallPolicy = DEFAULT_STALL_POLICY,
) -> OmniPipelineStatus:
    """Roll the children's real status up into conditions: Ready = StagesReady and
    RouterReady; StagesReady = every Stage<Name>Ready, of the serving revision (the
    pipeline's own when no rollout is given). A stage is ready while it serves (see
    _stage_condition); StagesAtCapacity says whether every stage also runs all its
    desired replicas, updated and ready. Progressing says whether a new revision is
    rolling out. model_cached (weights.source cache only) becomes ModelCached, and
    Ready's reason while the weights are what keeps it False. Reconciling and Stalled
    (kstatus' own, see stall.py) come from the update revision's stages, the pods and
    fetch_stall; a Stalled reason is Ready's too while Ready is False."""
    serving = rollout.current if rollout is not None else pipeline_revision(pipeline)
    before = {c.type: c for c in previous}
    before_stages = {s.name: s for s in previous_stages}
    conditions: list[Condition] = []
    stages: list[StageStatus] = []
    not_ready: list[str] = []
    below_capacity: list[str] = []
    for stage in pipeline.stages:
        worker = worker_name(pipeline, stage.name)
        observed = deployments.get(stage_deployment_name(pipeline.name, worker, serving))
        at_capacity = deployment_condition(f"stage {stage.name}", observed)
        status, reason, message = _stage_condition(at_capacity, observed)
        if at_capacity[0] is not ConditionStatus.TRUE:
            below_capacity.append(f"{stage.name} ({message})")
        conditions.append(
            condition(
                stage_condition_type(stage.name), status, reason, message, before, now, generation
            )
        )
        if status is not ConditionStatus.TRUE:
            not_ready.append(stage.name)
        # The autoscaler owns the scaling fields; status refreshes carry them over.
        carried = {
            f: getattr(before_stages[stage.name], f)
            for f in SCALING_FIELDS
            if stage.name in before_stages and stage.autoscaled
        }
        stages.append(
            StageStatus(
                name=stage.name,
                replicas=observed.replicas if observed else 0,
                ready_replicas=observed.ready if observed else 0,
                desired_replicas=observed.desired if observed else stage.replicas,
                **carried,
            )
        )
    stages_ok = ConditionStatus.FALSE if not_ready else ConditionStatus.TRUE
    stages_msg = f"not ready: {', '.join(not_ready)}" if not_ready else "all stages ready"
    capacity = (
        (ConditionStatus.FALSE, "StageBelowCapacity", "; ".join(below_capacity))
        if below_capacity
        else (ConditionStatus.TRUE, "AllStagesAtCapacity", "every desired replica is ready")
    )
    router = deployments.get(router_object_name(pipeline.name))
    router_status, router_reason, router_msg = _stage_condition(
        deployment_condition("router", router), router
    )
    ready = (
        ConditionStatus.TRUE
        if stages_ok is ConditionStatus.TRUE and router_status is ConditionStatus.TRUE
        else ConditionStatus.FALSE
    )
    update = rollout.update if rollout is not None else serving
    kstatus = progress(
        pipeline,
        update,
        rollout is not None and rollout.progressing,
        {name: d.ready for name, d in deployments.items()},
        pods,
        now,
        stall_policy,
        model_cached,
        fetch_stall,
    )
    if ready is ConditionStatus.TRUE:
        ready_reason, ready_msg = "Serving", f"serving at {endpoint}"
    elif kstatus.is_stalled:
        ready_reason, ready_msg = kstatus.stalled[1], kstatus.stalled[2]
    elif model_cached is not None and model_cached[0] is not ConditionStatus.TRUE:
        ready_reason, ready_msg = "ModelNotCached", model_cached[2]
    elif stages_ok is not ConditionStatus.TRUE:
        ready_reason, ready_msg = "StagesNotReady", stages_msg
    else:
        ready_reason, ready_msg = "RouterNotReady", router_msg
    roll_up = [
        condition("Ready", ready, ready_reason, ready_msg, before, now, generation),
        condition(
            "StagesReady",
            stages_ok,
            "AllStagesReady" if not not_ready else "StageNotReady",
            stages_msg,
            before,
            now,
            generation,
        ),
        condition("StagesAtCapacity", *capacity, before, now, generation),
        condition("RouterReady", router_status, router_reason, router_msg, before, now, generation),
    ]
    roll_up.append(condition("Progressing", *_progressing(rollout), before, now, generation))
    roll_up.append(condition("Reconciling", *kstatus.reconciling, before, now, generation))
    roll_up.append(condition("Stalled", *kstatus.stalled, before, now, generation))
    if model_cached is not None:
        roll_up.append(condition("ModelCached", *model_cached, before, now, generation))
    ready_count = len(pipeline.stages) - len(not_ready)
    # Conditions owned by others (the autoscaler's ScalingActive) pass through.
    mine = set(OWN_CONDITIONS) | {c.type for c in conditions}
    foreign = [c for c in previous if c.type not in mine]
    revisions: list[RevisionStatus] = []
    if rollout is not None:
        kept = [r for r in rollout.revisions if r not in rollout.retire]
        for revision in sorted(kept, key=lambda r: (r != rollout.update, r)):
            ready_stages, total = rollout.ready_count(revision)
            revisions.append(
                RevisionStatus(
                    revision=revision,
                    stages_ready=f"{ready_stages}/{total}",
                    ready=rollout.revision_ready(revision),
                )
            )
    return OmniPipelineStatus(
        conditions=roll_up + conditions + foreign,
        observed_generation=generation,
        stages=stages,
        stages_ready=f"{ready_count}/{len(pipeline.stages)}",
        endpoint=endpoint,
        current_revision=serving,
        update_revision=rollout.update if rollout else pipeline_revision(pipeline),
        revisions=revisions,
    )
