"""The Events a stall posts: one Warning when it begins or its reason changes, one
Normal when it ends, nothing while it stays as it was."""

from __future__ import annotations

from typing import Any

from omnipipe.api.status import Condition, ConditionStatus, OmniPipelineStatus
from omnipipe.operator.stall_events import stall_event


def status(stalled: tuple[str, str] | None) -> OmniPipelineStatus:
    ready = Condition(type="Ready", status=ConditionStatus.FALSE, reason="StagesNotReady")
    if stalled is None:
        stall = Condition(type="Stalled", status=ConditionStatus.FALSE, reason="NotStalled")
    else:
        stall = Condition(
            type="Stalled", status=ConditionStatus.TRUE, reason=stalled[0], message=stalled[1]
        )
    return OmniPipelineStatus(conditions=[ready, stall])


def stored(stalled: tuple[str, str] | None) -> dict[str, Any]:
    return status(stalled).model_dump(mode="json", by_alias=True, exclude_none=True)


def test_a_stall_is_announced_when_it_begins_or_changes_and_when_it_ends() -> None:
    pull = ("ImagePullFailed", "stage denoise: ImagePullBackOff")
    crash = ("CrashLoop", "stage encode: CrashLoopBackOff")
    assert stall_event({}, status(pull)) == (
        "Stalled",
        "ImagePullFailed: stage denoise: ImagePullBackOff",
        "Warning",
    )
    assert stall_event(stored(None), status(pull)) == stall_event({}, status(pull))
    assert stall_event(stored(pull), status(crash)) == (
        "Stalled",
        "CrashLoop: stage encode: CrashLoopBackOff",
        "Warning",
    )
    assert stall_event(stored(crash), status(None)) == (
        "StallCleared",
        "no longer stalled (CrashLoop)",
        "Normal",
    )


def test_a_status_that_stays_as_it_was_posts_nothing() -> None:
    pull = ("ImagePullFailed", "stage denoise: ImagePullBackOff")
    assert stall_event(stored(pull), status(pull)) is None
    # The message may change (a count, a pod's name): the reason is what is announced.
    assert stall_event(stored(pull), status((pull[0], "stage denoise: 2 pods"))) is None
    assert stall_event(stored(None), status(None)) is None
    assert stall_event({}, status(None)) is None
