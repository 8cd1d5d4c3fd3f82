"""Pure decisions: observed children -> status, and which children to delete."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omnipipe.api import ResolvedPipeline
from omnipipe.api import constants as c
from omnipipe.api.names import router_object_name, stage_condition_type, stage_deployment_name
from omnipipe.api.placement import worker_name, workloads
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.status import (
    Condition,
    ConditionStatus,
    OmniPipelineStatus,
    RevisionStatus,
    StageStatus,
)
from omnipipe.operator.stall import DEFAULT_STALL_POLICY, ObservedPod, StallPolicy, progress

ChildKey = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class ObservedDeployment:
    """The status fields of a Deployment that readiness depends on."""

    desired: int
    replicas: int
    ready: int
    updated: int
    up_to_date: bool  # the Deployment controller has seen the latest spec
    # A stage Deployment's labels: which stage, of which revision (None for the router).
    stage: str | None = None
    revision: str | None = None

    @classmethod
    def from_manifest(cls, obj: Mapping[str, Any]) -> ObservedDeployment:
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        return cls(
            desired=int(spec.get("replicas", 1)),
            replicas=int(status.get("replicas", 0)),
            ready=int(status.get("readyReplicas", 0)),
            updated=int(status.get("updatedReplicas", 0)),
            up_to_date=int(status.get("observedGeneration", 0)) >= int(meta.get("generation", 0)),
            stage=labels.get(c.LABEL_STAGE),
            revision=labels.get(c.LABEL_REVISION)
            or (c.LEGACY_REVISION if c.LABEL_STAGE in labels else None),
        )

    @property
    def available(self) -> bool:
        """Every desired replica is updated and ready (or none is desired)."""
        return _deployment_condition("", self)[0] is ConditionStatus.TRUE


def _deployment_condition(
    kind: str, observed: ObservedDeployment | None
) -> tuple[ConditionStatus, str, str]:
    """Whether the Deployment runs at capacity: it has seen its latest spec and every
    desired replica is updated and ready."""
    if observed is None:
        return ConditionStatus.FALSE, "Missing", f"the {kind} Deployment does not exist yet"
    if observed.desired == 0:
        return ConditionStatus.TRUE, "ScaledToZero", "scaled to zero; wakes on demand"
    counts = f"{observed.ready}/{observed.desired} replicas ready"
    if not observed.up_to_date or observed.updated < observed.desired:
        return ConditionStatus.FALSE, "RollingOut", counts
    if observed.ready < observed.desired:
        return ConditionStatus.FALSE, "ReplicasNotReady", counts
    return ConditionStatus.TRUE, "Available", counts


def _stage_condition(
    at_capacity: tuple[ConditionStatus, str, str], observed: ObservedDeployment | None
) -> tuple[ConditionStatus, str, str]:
    """Whether a stage (or the router) serves: one ready replica takes requests, so an
    autoscaler scale-up, a rolling update or a crash-looping pod beside a ready one
    leaves the stage ready. What it lacks of its capacity (at_capacity, from
    _deployment_condition) shows in the reason and in StagesAtCapacity, never in Ready."""
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


@dataclass(frozen=True)
class Rollout:
    """Where a pipeline's revisions stand, and what this step does about it.

    At most two revisions keep workloads: the serving (current) one and the one the
    spec asks for (update). The update revision takes over once every one of its stages
    is available (all its desired replicas updated and ready, not merely serving: the
    switch retires the old revision at once, so taking over on part of the replicas
    would cut capacity under load); then every other revision is retired (deleted: its
    pods drain on the way out). A revision superseded before it ever served is retired
    at once."""

    update: str
    current: str
    retire: tuple[str, ...]
    # revision -> stage -> its Deployment, for every revision that has one.
    revisions: Mapping[str, Mapping[str, ObservedDeployment]]
    update_stages: tuple[str, ...]

    @property
    def progressing(self) -> bool:
        return self.current != self.update

    def ready_count(self, revision: str) -> tuple[int, int]:
        """(available stages, stages) of one revision: the spec's stages for the update
        revision, the Deployments that exist for an older one."""
        have = self.revisions.get(revision, {})
        stages = self.update_stages if revision == self.update else tuple(sorted(have))
        ready = sum(1 for s in stages if s in have and have[s].available)
        return ready, len(stages)

    def revision_ready(self, revision: str) -> bool:
        ready, total = self.ready_count(revision)
        return total > 0 and ready == total


def by_revision(
    deployments: Iterable[ObservedDeployment],
) -> dict[str, dict[str, ObservedDeployment]]:
    grouped: dict[str, dict[str, ObservedDeployment]] = {}
    for d in deployments:
        if d.stage is not None and d.revision is not None:
            grouped.setdefault(d.revision, {})[d.stage] = d
    return grouped


def plan_rollout(
    pipeline: ResolvedPipeline,
    previous_current: str | None,
    deployments: Iterable[ObservedDeployment],
) -> Rollout:
    update = pipeline_revision(pipeline)
    grouped = by_revision(deployments)
    # Deployments are per worker: a stage's, or a colocated group's.
    stages = tuple(w.name for w in workloads(pipeline))
    draft = Rollout(update, update, (), grouped, stages)
    if previous_current not in grouped and c.LEGACY_REVISION in grouped:
        # An upgrade from before revisions: the unlabelled Deployments serve until the
        # first real revision is ready, like any old revision.
        previous_current = c.LEGACY_REVISION
    if draft.revision_ready(update) or previous_current not in grouped:
        # The new revision serves (or nothing else could): everything else goes.
        current = update
    else:
        assert previous_current is not None
        current = previous_current
    retire = tuple(sorted(r for r in grouped if r not in (current, update)))
    return Rollout(update, current, retire, grouped, stages)


def initial_replicas(
    pipeline: ResolvedPipeline,
    rollout: Rollout,
    created: Iterable[str],
) -> dict[str, int]:
    """Deployment name -> replicas, for the autoscaled stages of a new revision whose
    Deployments were just created: they start where the serving revision's are now, so
    a rollout under load does not start from the minimum."""
    serving = rollout.revisions.get(rollout.current, {})
    new = set(created)
    start: dict[str, int] = {}
    if not rollout.progressing:
        return start
    for stage in pipeline.stages:
        name = stage_deployment_name(pipeline.name, stage.name, rollout.update)
        if stage.autoscaled and name in new and stage.name in serving:
            start[name] = serving[stage.name].desired
    return start


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
        at_capacity = _deployment_condition(f"stage {stage.name}", observed)
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
        _deployment_condition("router", router), router
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


def child_key(obj: Mapping[str, Any]) -> ChildKey:
    return str(obj["kind"]), str(obj["metadata"]["name"])


def child_revision(obj: Mapping[str, Any]) -> str | None:
    """The revision a child belongs to; None for the children every revision shares.
    A stage Deployment or the pipeline ConfigMap without a revision label was made
    before revisions: it belongs to the legacy revision."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    revision = labels.get(c.LABEL_REVISION)
    if revision is not None:
        return str(revision)
    kind = obj.get("kind")
    if (kind == "Deployment" and c.LABEL_STAGE in labels) or (
        kind == "ConfigMap" and labels.get(c.LABEL_COMPONENT) == "config"
    ):
        return c.LEGACY_REVISION
    return None


def orphans(
    existing: Mapping[ChildKey, Mapping[str, Any]] | Iterable[ChildKey],
    desired: Iterable[ChildKey],
    update_revision: str | None = None,
) -> list[ChildKey]:
    """Children the pipeline no longer wants (a removed stage), in a stable order. A
    child of another revision than the update one is the rollout's to retire, not an
    orphan (see plan_rollout)."""
    wanted = set(desired)
    if isinstance(existing, Mapping):
        return sorted(
            key
            for key, obj in existing.items()
            if key not in wanted
            and (update_revision is None or child_revision(obj) in (None, update_revision))
        )
    return sorted(set(existing) - wanted)


def revision_children(
    existing: Mapping[ChildKey, Mapping[str, Any]], revisions: Iterable[str]
) -> list[ChildKey]:
    """The children (Deployments, ConfigMaps) of the given revisions, in a stable order."""
    wanted = set(revisions)
    return sorted(key for key, obj in existing.items() if child_revision(obj) in wanted)
