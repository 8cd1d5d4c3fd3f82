"""What a reload of `omnipipe serve`'s file changes: pure, from the running and the new
resolved pipeline to the workers to start and to retire (see Supervisor.reload)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnipipe.api import ResolvedPipeline, ResolvedStage
from omnipipe.api.adapters import Adapter
from omnipipe.api.placement import Workload
from omnipipe.api.revision import pipeline_revision


def local_replicas(stage: ResolvedStage) -> int:
    """Local mode has no autoscaler to wake a stage: it runs at least one worker."""
    return max(stage.replicas, 1)


def workload_replicas(pipeline: ResolvedPipeline, workload: Workload) -> int:
    """Processes of a stage's or a group's workers: a group's stages share its count."""
    return local_replicas(pipeline.stage(workload.stages[0]))


def router_view(pipeline: ResolvedPipeline) -> dict[str, Any]:
    """What the local router fixes at its start: the pipeline's name (its model id, its
    metrics' label), its type and the stage graph it plans requests over. The router is
    one process bound to the port the clients use, so these cannot change under it. The
    model is not here: the router learns each revision's from its snapshot, named in the
    replicas file, and answers for it once new requests start on that revision."""
    return {
        "name": pipeline.name,
        "pipeline": pipeline.pipeline,
        "outputs": list(pipeline.outputs),
        "stages": [(s.name, s.role.value, list(s.inputs)) for s in pipeline.stages],
        # Every process makes its tracer at its start, the router included.
        "tracing": pipeline.tracing.model_dump(mode="json"),
        # Which stages share a process: the workers' URLs and their processes.
        "placement": [(g.name, list(g.stages)) for g in pipeline.groups],
    }


def _in_place_fields(stage: ResolvedStage) -> dict[str, Any]:
    """A stage's settings a running worker was started with (ResolvedStage.restart_fields)."""
    return stage.restart_fields()


@dataclass(frozen=True)
class ReloadPlan:
    old_revision: str
    new_revision: str
    replace: tuple[str, ...]
    """Stages whose workers all give way to new ones: every stage on a new revision;
    on the same revision, the stages whose settings changed (they roll in place)."""
    counts: dict[str, tuple[int, int]]
    """Stage -> (workers now, workers wanted), for the stages not replaced."""
    refused: str = ""
    """Why this change cannot be applied to the running router (empty: it can)."""
    adapters: dict[str, tuple[Adapter, ...]] = field(default_factory=dict)
    """Stage -> its new LoRA adapters, for the stages not replaced whose set changed:
    their running workers load and unload them."""

    @property
    def new_revision_rolls_out(self) -> bool:
        return self.old_revision != self.new_revision

    @property
    def changes_anything(self) -> bool:
        return (
            bool(self.replace)
            or bool(self.adapters)
            or any(now != want for now, want in self.counts.values())
        )


def plan_reload(old: ResolvedPipeline, new: ResolvedPipeline) -> ReloadPlan:
    old_rev, new_rev = pipeline_revision(old), pipeline_revision(new)
    before, after = router_view(old), router_view(new)
    if before != after:
        changed = sorted(k for k in after if before[k] != after[k])
        return ReloadPlan(
            old_rev,
            new_rev,
            (),
            {},
            refused=f"it changes {', '.join(changed)}: the running router is built on the "
            "pipeline's name, type and stage graph, and every process on its tracing (a "
            "model change reloads, these do not); restart `omnipipe serve` to apply it",
        )
    old_stages = {s.name: s for s in old.stages}
    if old_rev != new_rev:
        replace = tuple(s.name for s in new.stages)
    else:
        replace = tuple(
            s.name
            for s in new.stages
            if _in_place_fields(s) != _in_place_fields(old_stages[s.name])
        )
    counts = {
        s.name: (local_replicas(old_stages[s.name]), local_replicas(s))
        for s in new.stages
        if s.name not in replace
    }
    adapters = {
        s.name: s.adapters
        for s in new.stages
        if s.name not in replace and s.adapters != old_stages[s.name].adapters
    }
    return ReloadPlan(old_rev, new_rev, replace, counts, adapters=adapters)
