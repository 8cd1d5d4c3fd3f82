"""Pure decisions: observed children -> status, and which children to delete."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omnipipe.api import ResolvedPipeline
from omnipipe.api.names import router_object_name, stage_condition_type, stage_object_name
from omnipipe.api.status import Condition, ConditionStatus, OmniPipelineStatus, StageStatus

ChildKey = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class ObservedDeployment:
    """The status fields of a Deployment that readiness depends on."""

    desired: int
    replicas: int
    ready: int
    updated: int
    up_to_date: bool  # the Deployment controller has seen the latest spec

    @classmethod
    def from_manifest(cls, obj: Mapping[str, Any]) -> ObservedDeployment:
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        generation = (obj.get("metadata") or {}).get("generation", 0)
        return cls(
            desired=int(spec.get("replicas", 1)),
            replicas=int(status.get("replicas", 0)),
            ready=int(status.get("readyReplicas", 0)),
            updated=int(status.get("updatedReplicas", 0)),
            up_to_date=int(status.get("observedGeneration", 0)) >= int(generation),
        )


def _deployment_condition(
    kind: str, observed: ObservedDeployment | None
) -> tuple[ConditionStatus, str, str]:
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


def _condition(
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


SCALING_FIELDS = (
    "metric",
    "metric_value",
    "last_decision",
    "last_decision_reason",
    "last_scale_time",
)
OWN_CONDITIONS = ("Ready", "StagesReady", "RouterReady")


def compute_status(
    pipeline: ResolvedPipeline,
    generation: int | None,
    deployments: Mapping[str, ObservedDeployment],
    previous: Sequence[Condition],
    endpoint: str,
    now: str,
    previous_stages: Sequence[StageStatus] = (),
) -> OmniPipelineStatus:
    """Roll the children's real status up into conditions: Ready = StagesReady and
    RouterReady; StagesReady = every Stage<Name>Ready."""
    before = {c.type: c for c in previous}
    before_stages = {s.name: s for s in previous_stages}
    conditions: list[Condition] = []
    stages: list[StageStatus] = []
    not_ready: list[str] = []
    for stage in pipeline.stages:
        observed = deployments.get(stage_object_name(pipeline.name, stage.name))
        status, reason, message = _deployment_condition(f"stage {stage.name}", observed)
        conditions.append(
            _condition(
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
    router_status, router_reason, router_msg = _deployment_condition(
        "router", deployments.get(router_object_name(pipeline.name))
    )
    ready = (
        ConditionStatus.TRUE
        if stages_ok is ConditionStatus.TRUE and router_status is ConditionStatus.TRUE
        else ConditionStatus.FALSE
    )
    if ready is ConditionStatus.TRUE:
        ready_reason, ready_msg = "Serving", f"serving at {endpoint}"
    elif stages_ok is not ConditionStatus.TRUE:
        ready_reason, ready_msg = "StagesNotReady", stages_msg
    else:
        ready_reason, ready_msg = "RouterNotReady", router_msg
    roll_up = [
        _condition("Ready", ready, ready_reason, ready_msg, before, now, generation),
        _condition(
            "StagesReady",
            stages_ok,
            "AllStagesReady" if not not_ready else "StageNotReady",
            stages_msg,
            before,
            now,
            generation,
        ),
        _condition(
            "RouterReady", router_status, router_reason, router_msg, before, now, generation
        ),
    ]
    ready_count = len(pipeline.stages) - len(not_ready)
    # Conditions owned by others (the autoscaler's ScalingActive) pass through.
    mine = set(OWN_CONDITIONS) | {c.type for c in conditions}
    foreign = [c for c in previous if c.type not in mine]
    return OmniPipelineStatus(
        conditions=roll_up + conditions + foreign,
        observed_generation=generation,
        stages=stages,
        stages_ready=f"{ready_count}/{len(pipeline.stages)}",
        endpoint=endpoint,
    )


def child_key(obj: Mapping[str, Any]) -> ChildKey:
    return str(obj["kind"]), str(obj["metadata"]["name"])


def orphans(existing: Iterable[ChildKey], desired: Iterable[ChildKey]) -> list[ChildKey]:
    """Children the pipeline no longer wants (a removed stage), in a stable order."""
    return sorted(set(existing) - set(desired))
