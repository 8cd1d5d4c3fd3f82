"""Where stages run: each in processes of its own (the default), or several in one.

A colocated group is one process per replica: its stages hand tensors over by reference
and share the process's cores (or one GPU), each keeping its own queue and batching. It
serves small models and single-GPU machines, where a process hop and core contention cost
more than scaling each stage alone would save. See docs/architecture.md, "Co-location".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from omnipipe.api import constants as c
from omnipipe.api.spec_base import DnsLabel, SpecModel

if TYPE_CHECKING:
    from omnipipe.api.resolve import ResolvedPipeline

MAX_GROUP_NAME = 12
MAX_GROUPS = 8
IMPLICIT_GROUP = "all"
STAGE_PATH_PREFIX = "/stages/"


class PlacementMode(StrEnum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


class Group(SpecModel):
    """Stages that run in one process, scaled as one."""

    name: Annotated[
        str, Field(pattern=c.DNS_LABEL_PATTERN, min_length=1, max_length=MAX_GROUP_NAME)
    ]
    """The group's name (a stage's name is taken); its workers are named for it."""
    stages: Annotated[list[DnsLabel], Field(min_length=2, max_length=c.MAX_STAGES)] | None = None
    """Its stages, at least two. A lone group may leave it out: it then holds every stage."""
    replicas: Annotated[int, Field(ge=1, le=1000)] = 1
    """Processes (pods) of the group, each running all of its stages; it scales as one."""


class Placement(SpecModel):
    """How the stages are laid out in processes."""

    mode: PlacementMode = PlacementMode.DISAGGREGATED
    """disaggregated: a process (a Deployment) per stage, each scaled on its own.
    colocated: the stages of each group share one process (one Deployment on Kubernetes)
    and hand tensors over by reference. It cannot change on a running pipeline."""
    groups: Annotated[list[Group], Field(max_length=MAX_GROUPS)] = Field(default_factory=list)
    """The colocated groups; left out, one group "all" holds every stage. A stage in no
    group runs on its own, as in disaggregated mode."""


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
