"""spec.placement: which stages share a process.

A colocated group is one process per replica: its stages hand tensors over by reference
and share the process's cores (or one GPU), each keeping its own queue and batching. It
serves small models and single-GPU machines, where a process hop and core contention cost
more than scaling each stage alone would save. See docs/architecture.md, "Co-location".

The models alone: the stage-graph rules (api/pipelines.py) read them and run from the
spec's validator, so they sit below both. The processes a resolved pipeline runs as are
api/placement.py's.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from omnipipe.api import constants as c
from omnipipe.api.spec_base import DnsLabel, SpecModel

MAX_GROUP_NAME = 12
MAX_GROUPS = 8
IMPLICIT_GROUP = "all"


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
