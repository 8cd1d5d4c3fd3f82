"""Status of an OmniPipeline: conditions, not phases."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from omnipipe.api.spec_base import SpecModel


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(SpecModel):
    """An observation of one aspect of the pipeline (Kubernetes API conventions)."""

    type: Annotated[str, Field(max_length=316)]
    """Condition type: Ready, Reconciling, Stalled, StagesReady, StagesAtCapacity,
    RouterReady, Progressing, ModelCached, ScalingActive or Stage<Name>Ready."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: Annotated[str, Field(max_length=1024)] = ""
    """CamelCase reason for the last transition."""
    message: Annotated[str, Field(max_length=32768)] = ""
    """Human-readable detail."""
    last_transition_time: str | None = None
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The metadata.generation this condition was computed for."""


class StageStatus(SpecModel):
    """Observed replicas of one stage."""

    name: str
    """Stage name."""
    replicas: int = 0
    """Pods of the stage's Deployment."""
    ready_replicas: int = 0
    """Pods that pass their readiness probe."""
    desired_replicas: int = 0
    """Replicas wanted now: the fixed count or the autoscaler's latest decision."""
    metric: str | None = None
    """The autoscaling signal's name."""
    metric_value: float | None = None
    """The signal's latest value, as the autoscaler last read it."""
    last_decision: str | None = None
    """The autoscaler's latest decision and why."""
    last_decision_reason: str | None = None
    """CamelCase reason of that decision: ScaleUp, ScaleDown, WithinTolerance, ..."""
    last_scale_time: str | None = None
    """When the autoscaler last changed the replica count (RFC 3339)."""


class RevisionStatus(SpecModel):
    """One revision whose stage workloads exist."""

    revision: str
    """The revision: a hash of the model, engines, stage graph and engine arguments."""
    stages_ready: str
    """Ready stages of this revision over its stages, e.g. 2/3."""
    ready: bool = False
    """Every stage of the revision is ready: it can serve whole requests."""


class OmniPipelineStatus(SpecModel):
    """Observed state of the pipeline, computed from its children."""

    conditions: list[Condition] = Field(default_factory=list)
    """Ready rolls up StagesReady, RouterReady and one condition per stage (of the
    serving revision). Progressing is True while a new revision rolls out. Reconciling
    (True while the operator works toward the spec) and Stalled (True when it cannot get
    there without a change from the user) follow kstatus, which Flux and kubectl read."""
    observed_generation: int | None = None
    """The metadata.generation the operator last reconciled."""
    stages: list[StageStatus] = Field(default_factory=list)
    """Per-stage replica counts."""
    stages_ready: str | None = None
    """Ready stages over all stages, e.g. 2/3."""
    endpoint: str | None = None
    """The router's OpenAI-compatible base URL."""
    current_revision: str | None = None
    """The revision that serves requests: the newest whose stages were all ready."""
    update_revision: str | None = None
    """The revision the spec asks for. It differs from currentRevision while it rolls
    out beside it."""
    revisions: list[RevisionStatus] = Field(default_factory=list)
    """Every revision whose stage workloads exist, with its readiness."""
