"""Pure decisions from the observed children: which revision serves and which retire,
where a new revision's autoscaled stages start, and which children to delete."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omnipipe.api import ResolvedPipeline
from omnipipe.api import constants as c
from omnipipe.api.names import stage_deployment_name
from omnipipe.api.placement import workloads
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.status import ConditionStatus

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
        return deployment_condition("", self)[0] is ConditionStatus.TRUE


def deployment_condition(
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
