"""The processes a resolved pipeline runs as: each stage in processes of its own (the
default), or the stages of a colocated group in one (spec.placement, whose models are in
api/placement_spec.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from omnipipe.api.resolve import ResolvedPipeline

STAGE_PATH_PREFIX = "/stages/"


@dataclass(frozen=True)
class Workload:
    """One kind of process: a stage alone (group "") or a group of stages."""

    name: str
    stages: tuple[str, ...]
    group: str = ""

    @property
    def colocated(self) -> bool:
        return bool(self.group)


def workloads(pipeline: ResolvedPipeline) -> tuple[Workload, ...]:
    """Every process kind of the pipeline, in the order of their first stage."""
    grouped = {s: g for g in pipeline.groups for s in g.stages}
    out: list[Workload] = []
    for stage in pipeline.stages:
        group = grouped.get(stage.name)
        if group is None:
            out.append(Workload(stage.name, (stage.name,)))
        elif stage.name == group.stages[0]:
            out.append(Workload(group.name, group.stages, group.name))
    return tuple(out)


def workload_of(pipeline: ResolvedPipeline, stage: str) -> Workload:
    for workload in workloads(pipeline):
        if stage in workload.stages:
            return workload
    raise KeyError(f"pipeline {pipeline.name} has no stage {stage!r}")


def worker_name(pipeline: ResolvedPipeline, stage: str) -> str:
    """What a stage's workers are named and labelled for: the stage, or its group. On
    Kubernetes: its Deployment's name and its pods' stage label."""
    return workload_of(pipeline, stage).name


def control_path(workload: Workload, stage: str) -> str:
    """Where a stage's control API sits under its process's root URL."""
    return f"{STAGE_PATH_PREFIX}{stage}" if workload.colocated else ""
