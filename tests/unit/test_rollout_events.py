"""The events a rollout posts tell one story whatever the timing: a revision switch is
always preceded by the start of its rollout, also when the new revision was ready the
first time the operator looked (under load, a reconcile that creates the Deployments can
find them ready when it reads them back), and nothing is posted twice."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from omnipipe.operator.k8s import Kube
from omnipipe.operator.planner import Rollout
from omnipipe.operator.reconcile import _advance_rollout


class EventRecorder:
    """A stand-in (a fake) for the Kube API client, of which _advance_rollout uses only
    post_event when no revision is retired: it records the reasons posted."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    async def post_event(self, owner: Any, reason: str, message: str, type_: str = "") -> None:
        self.reasons.append(reason)


def posted(status: dict[str, str], rollout: Rollout) -> list[str]:
    recorder = EventRecorder()
    body = {"metadata": {"name": "p", "namespace": "ns"}, "status": status}
    asyncio.run(_advance_rollout(cast(Kube, recorder), body, "ns", rollout))
    return recorder.reasons


def rollout(update: str, current: str) -> Rollout:
    return Rollout(update, current, (), {}, ("encode", "denoise", "decode"))


def test_a_rollout_that_takes_over_at_once_still_starts_first() -> None:
    serving = {"currentRevision": "r2", "updateRevision": "r2"}
    assert posted(serving, rollout("r1", "r1")) == ["RolloutStarted", "RevisionSwitched"]


def test_a_rollout_seen_in_progress_starts_then_switches_once() -> None:
    serving = {"currentRevision": "r2", "updateRevision": "r2"}
    assert posted(serving, rollout("r1", "r2")) == ["RolloutStarted"]
    started = {"currentRevision": "r2", "updateRevision": "r1"}
    assert posted(started, rollout("r1", "r2")) == []
    assert posted(started, rollout("r1", "r1")) == ["RevisionSwitched"]


def test_a_new_pipeline_and_an_in_place_change_post_nothing() -> None:
    assert posted({}, rollout("r1", "r1")) == []
    same = {"currentRevision": "r1", "updateRevision": "r1"}
    assert posted(same, rollout("r1", "r1")) == []
