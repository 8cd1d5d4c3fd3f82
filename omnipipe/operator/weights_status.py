"""Pure: observed fetch Jobs and their pods -> the ModelCached condition.

A claim counts as filled only when its Job succeeded, which `omnipipe fetch` allows only
after renaming a complete download into place. A failed attempt's reason comes from its
container's termination message (`reason: NoSpace` as the last such line)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omnipipe.api.status import ConditionStatus

_REASON = re.compile(r"^reason: ([A-Za-z]+)\s*$", re.MULTILINE)
_DETAIL = re.compile(r"^omnipipe fetch: (.+)$", re.MULTILINE)
# The fetch did not say why (an unexpected crash, an evicted pod).
UNKNOWN_FAILURE = "FetchFailed"
# The source said the model is not there for us: no retry can change that.
MODEL_REFUSED = frozenset({"UnknownModel", "UnknownRevision", "NoAccess"})


@dataclass(frozen=True)
class FetchFailure:
    reason: str
    message: str


@dataclass(frozen=True)
class ObservedFetch:
    """One fetch Job as the operator last saw it."""

    job: str
    model: str
    succeeded: bool
    gave_up: bool  # the Job controller marked it Failed: no more attempts
    failed_attempts: int
    last_failure: FetchFailure | None
    # Why the current attempt's pod cannot be scheduled (an unbound claim, no node).
    unschedulable: str | None = None

    @classmethod
    def from_manifests(
        cls, job: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]
    ) -> ObservedFetch:
        meta, status = job.get("metadata") or {}, job.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or [] if c}
        complete = (conditions.get("Complete") or {}).get("status") == "True"
        failed = conditions.get("Failed") or {}
        gave_up = failed.get("status") == "True"
        failure = last_failure(pods)
        if failure is None and gave_up:
            # Its pods are gone (deleted by hand, or by a pod garbage collector): the
            # Job's own word is all that is left.
            failure = FetchFailure(
                str(failed.get("reason") or UNKNOWN_FAILURE), str(failed.get("message") or "")
            )
        return cls(
            job=str(meta.get("name")),
            model=str((meta.get("annotations") or {}).get("omnipipe.io/model", "")),
            succeeded=int(status.get("succeeded") or 0) > 0 or complete,
            gave_up=gave_up,
            failed_attempts=int(status.get("failed") or 0),
            last_failure=failure,
            unschedulable=unschedulable(pods),
        )


def parse_termination_message(message: str) -> FetchFailure:
    reasons = _REASON.findall(message)
    details = _DETAIL.findall(message)
    if not reasons:
        tail = message.strip().splitlines()[-1:] or ["the fetch exited without a reason"]
        return FetchFailure(UNKNOWN_FAILURE, tail[0])
    return FetchFailure(reasons[-1], details[-1] if details else reasons[-1])


def _terminated(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(finishedAt, message) of a failed fetch pod's container."""
    status = pod.get("status") or {}
    if status.get("phase") != "Failed":
        return None
    for container in status.get("containerStatuses") or []:
        state = (container.get("state") or {}).get("terminated")
        if state:
            return str(state.get("finishedAt") or ""), str(state.get("message") or "")
    return "", str(status.get("message") or "")


def unschedulable(pods: Iterable[Mapping[str, Any]]) -> str | None:
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") != "Pending":
            continue
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                return str(cond.get("message") or cond.get("reason") or "unschedulable")
    return None


def last_failure(pods: Iterable[Mapping[str, Any]]) -> FetchFailure | None:
    failed = [t for p in pods if (t := _terminated(p)) is not None]
    if not failed:
        return None
    _, message = max(failed, key=lambda t: t[0])
    return parse_termination_message(message)


def model_cached(
    expected: Sequence[tuple[str, str]],
    observed: Mapping[str, ObservedFetch],
    backoff_limit: int,
) -> tuple[ConditionStatus, str, str]:
    """The ModelCached condition over every (model, Job name) the spec wants cached.

    Reasons: Cached; Fetching (nothing failed yet); FetchPending (its pod cannot be
    scheduled: an unbound claim, no node); a fetch's own reason (NoSpace,
    NoAccess, UnknownModel, UnknownRevision, Unreachable, ...) once an attempt failed,
    while it is retried and after the Job gave up; the message says which."""
    done = [m for m, job in expected if job in observed and observed[job].succeeded]
    progress = f"{len(done)}/{len(expected)} models cached"
    attempts = backoff_limit + 1
    for model, job in expected:
        fetch = observed.get(job)
        if fetch is None or fetch.succeeded or fetch.failed_attempts == 0:
            continue
        failure = fetch.last_failure or FetchFailure(UNKNOWN_FAILURE, "no reason recorded")
        if fetch.gave_up:
            return (
                ConditionStatus.FALSE,
                failure.reason,
                f"{progress}; fetching {model} failed {fetch.failed_attempts} times, "
                f"giving up: {failure.message}. Fix the cause, then `kubectl delete job "
                f"{job}` and the operator fetches again",
            )
        return (
            ConditionStatus.FALSE,
            failure.reason,
            f"{progress}; fetching {model}: attempt {fetch.failed_attempts} of {attempts} "
            f"failed: {failure.message}; retrying with back-off (Job {job})",
        )
    if len(done) == len(expected):
        return ConditionStatus.TRUE, "Cached", progress
    for model, job in expected:
        fetch = observed.get(job)
        if fetch is not None and not fetch.succeeded and fetch.unschedulable:
            return (
                ConditionStatus.FALSE,
                "FetchPending",
                f"{progress}; the fetch of {model} cannot start (Job {job}): {fetch.unschedulable}",
            )
    waiting = [m for m, job in expected if m not in done]
    return (
        ConditionStatus.FALSE,
        "Fetching",
        f"{progress}; fetching {', '.join(waiting)}; its stages start once it is cached",
    )


def fetch_stall(
    expected: Sequence[tuple[str, str]], observed: Mapping[str, ObservedFetch]
) -> tuple[str, str] | None:
    """(reason, message) when a fetch cannot succeed without a change from the user:
    ModelRefused at the first attempt the source refused (no such model or revision,
    no access), FetchFailed once the Job gave up for any other reason."""
    for model, job in expected:
        fetch = observed.get(job)
        if fetch is None or fetch.succeeded or fetch.failed_attempts == 0:
            continue
        failure = fetch.last_failure or FetchFailure(UNKNOWN_FAILURE, "no reason recorded")
        if failure.reason in MODEL_REFUSED:
            return "ModelRefused", f"fetching {model}: {failure.reason}: {failure.message}"
        if fetch.gave_up:
            return (
                "FetchFailed",
                f"fetching {model} gave up after {fetch.failed_attempts} attempts: "
                f"{failure.reason}: {failure.message} (Job {job})",
            )
    return None
