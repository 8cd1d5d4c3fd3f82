"""Pure: the Event a status change posts about a stall. `kubectl get events` and
`kubectl describe omnip` then say what went wrong and when, beside the Stalled condition
that GitOps tools read: a Warning when a stall begins or its reason changes, and a Normal
event once it ends. A status that stays stalled for the same reason posts nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnipipe.api.status import ConditionStatus, OmniPipelineStatus

STALLED = "Stalled"


def _stall_of(conditions: object) -> tuple[str, str] | None:
    """(reason, message) of a Stalled=True condition among `conditions` (as stored)."""
    for condition in conditions if isinstance(conditions, list) else ():
        stalled = isinstance(condition, Mapping) and condition.get("type") == STALLED
        if stalled and condition.get("status") == ConditionStatus.TRUE.value:
            return str(condition.get("reason", "")), str(condition.get("message", ""))
    return None


def stall_event(
    before: Mapping[str, Any], after: OmniPipelineStatus
) -> tuple[str, str, str] | None:
    """(reason, message, type) of the Event that the change from status `before` (as
    stored) to `after` posts, if any."""
    was = _stall_of(before.get("conditions"))
    now = _stall_of([c.model_dump(mode="json") for c in after.conditions if c.type == STALLED])
    if now is not None and (was is None or was[0] != now[0]):
        reason, message = now
        return STALLED, f"{reason}: {message}" if message else reason, "Warning"
    if now is None and was is not None:
        return "StallCleared", f"no longer stalled ({was[0]})", "Normal"
    return None
