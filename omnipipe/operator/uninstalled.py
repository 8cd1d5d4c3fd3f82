"""Pure: the status of a pipeline whose type no family installed in this operator
registers. The CRD was generated where that family was installed (`omnipipe crd` in an
image with the plugin), so the API server took the resource; this operator cannot build
it, and says so in Stalled, which no waiting fixes, rather than retrying forever."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omnipipe.api.families import installed_summary, pipeline_type_names
from omnipipe.api.status import Condition, ConditionStatus, OmniPipelineStatus
from omnipipe.operator.status_rollup import condition

REASON = "PipelineTypeNotInstalled"


def uninstalled_pipeline_type(body: Mapping[str, Any]) -> str | None:
    """The resource's pipeline type when no installed family registers it."""
    pipeline = (body.get("spec") or {}).get("pipeline")
    if isinstance(pipeline, str) and pipeline not in pipeline_type_names():
        return pipeline
    return None


def uninstalled_status(
    pipeline: str,
    generation: int | None,
    previous: Sequence[Condition],
    now: str,
) -> OmniPipelineStatus:
    """Ready False and Stalled True, naming the families that are installed."""
    message = (
        f"pipeline type {pipeline!r} is not installed in this operator; installed "
        f"families: {installed_summary()}. Install the package of the family that "
        "registers it in the operator's image. What it built before, if anything, is left "
        "as it is."
    )
    before = {c.type: c for c in previous}
    false, true = ConditionStatus.FALSE, ConditionStatus.TRUE
    return OmniPipelineStatus(
        conditions=[
            condition("Ready", false, REASON, message, before, now, generation),
            condition(
                "Reconciling", false, REASON, "nothing to reconcile", before, now, generation
            ),
            condition("Stalled", true, REASON, message, before, now, generation),
        ],
        observed_generation=generation,
    )
