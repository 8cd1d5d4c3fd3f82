"""Pure: the kstatus conditions, Reconciling and Stalled, from the children as observed.

GitOps tools read them as Flux's kstatus does: Reconciling=True is InProgress, and
Stalled=True is the only way to Failed. So Stalled is kept for what no waiting fixes (a
refused model, an image that cannot be pulled, a crash loop, a pod no node takes), and
only for a stage below its minimum: an autoscaler's extra replica that cannot start
leaves a serving pipeline Current, and shows in StagesAtCapacity instead."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from omnipipe.api import ResolvedPipeline, ResolvedStage
from omnipipe.api import constants as c
from omnipipe.api.names import router_object_name, stage_deployment_name
from omnipipe.api.placement import worker_name
from omnipipe.api.status import ConditionStatus

# A container waiting for one of these will wait forever: nothing but a change to the
# image, its name or the node's images helps. ErrImagePull is left out: the first
# failure of a pull that may yet succeed (a registry that blinked).
_IMAGE_PULL_FAILED = frozenset({"ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName"})
# The pod's configuration names something that does not exist (a Secret, a key).
_CONFIG_FAILED = frozenset({"CreateContainerConfigError", "CreateContainerError"})
_MESSAGE_TAIL = 300


@dataclass(frozen=True)
class StallPolicy:
    crash_loop_restarts: int = 3
    """Restarts after which a crash-looping container stalls its stage."""
    unschedulable_seconds: float = 60.0
    """How long a pod may wait for a node before its stage is stalled (a cluster
    autoscaler adds nodes within this)."""


DEFAULT_STALL_POLICY = StallPolicy()


@dataclass(frozen=True)
class ContainerWait:
    name: str
    reason: str
    message: str
    restarts: int
    last_exit: int | None
    last_message: str


@dataclass(frozen=True)
class ObservedPod:
    """What a pod of a stage or of the router shows about why it does not run."""

    name: str
    component: str | None
    stage: str | None
    revision: str | None
    unschedulable_since: str | None
    unschedulable_message: str
    waiting: tuple[ContainerWait, ...]

    @classmethod
    def from_manifest(cls, pod: Mapping[str, Any]) -> ObservedPod:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        since, message = None, ""
        for cond in status.get("conditions") or []:
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                since = str(cond.get("lastTransitionTime") or "") or None
                message = str(cond.get("message") or "")
        containers = [
            *(status.get("initContainerStatuses") or []),
            *(status.get("containerStatuses") or []),
        ]
        return cls(
            name=str(meta.get("name", "")),
            component=labels.get(c.LABEL_COMPONENT),
            stage=labels.get(c.LABEL_STAGE),
            revision=labels.get(c.LABEL_REVISION),
            unschedulable_since=since,
            unschedulable_message=message,
            waiting=tuple(w for s in containers if (w := _waiting(s)) is not None),
        )


def _waiting(status: Mapping[str, Any]) -> ContainerWait | None:
    waiting = (status.get("state") or {}).get("waiting")
    if not waiting:
        return None
    last = (status.get("lastState") or {}).get("terminated") or {}
    exit_code = last.get("exitCode")
    return ContainerWait(
        name=str(status.get("name", "")),
        reason=str(waiting.get("reason") or ""),
        message=str(waiting.get("message") or ""),
        restarts=int(status.get("restartCount") or 0),
        last_exit=int(exit_code) if exit_code is not None else None,
        last_message=str(last.get("message") or ""),
    )


def _tail(text: str) -> str:
    """The last non-empty line of a message, shortened: a termination message may be
    the whole log's tail (FallbackToLogsOnError)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last if len(last) <= _MESSAGE_TAIL else "..." + last[-_MESSAGE_TAIL:]


def _seconds_between(earlier: str, later: str) -> float:
    try:
        start = datetime.fromisoformat(earlier.replace("Z", "+00:00"))
        end = datetime.fromisoformat(later.replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    return (end - start).total_seconds()


def pod_trouble(pod: ObservedPod, now: str, policy: StallPolicy) -> tuple[str, str] | None:
    """(reason, message) when the pod cannot run without a change from the user."""
    for wait in pod.waiting:
        where = f"pod {pod.name}, container {wait.name}"
        if wait.reason in _IMAGE_PULL_FAILED:
            return "ImagePullFailed", f"{where}: {wait.reason}: {_tail(wait.message)}"
        if wait.reason in _CONFIG_FAILED:
            return "ContainerConfigFailed", f"{where}: {wait.reason}: {_tail(wait.message)}"
        if wait.reason == "CrashLoopBackOff" and wait.restarts >= policy.crash_loop_restarts:
            exited = f"exit code {wait.last_exit}" if wait.last_exit is not None else "exited"
            said = _tail(wait.last_message)
            return (
                "CrashLooping",
                f"{where}: restarted {wait.restarts} times, {exited}"
                + (f": {said}" if said else ""),
            )
    if pod.unschedulable_since is not None and (
        _seconds_between(pod.unschedulable_since, now) >= policy.unschedulable_seconds
    ):
        return "Unschedulable", f"pod {pod.name}: {_tail(pod.unschedulable_message)}"
    return None


def stage_minimum(stage: ResolvedStage) -> int:
    """Ready replicas below which the stage is not yet what the spec asks for."""
    return stage.autoscaling.min_replicas if stage.autoscaling is not None else stage.replicas


@dataclass(frozen=True)
class Progress:
    """The Reconciling and Stalled conditions, as (status, reason, message) each."""

    reconciling: tuple[ConditionStatus, str, str]
    stalled: tuple[ConditionStatus, str, str]

    @property
    def is_stalled(self) -> bool:
        return self.stalled[0] is ConditionStatus.TRUE


def progress(
    pipeline: ResolvedPipeline,
    update_revision: str,
    rolling_out: bool,
    ready_replicas: Mapping[str, int | None],
    pods: Iterable[ObservedPod],
    now: str,
    policy: StallPolicy,
    weights: tuple[ConditionStatus, str, str] | None = None,
    fetch_stall: tuple[str, str] | None = None,
) -> Progress:
    """ready_replicas: Deployment name -> its ready replicas (None: it does not exist
    yet), for the update revision's stages and the router. weights: ModelCached, when
    the spec caches its model; fetch_stall: a fetch that no retry helps."""
    pods = list(pods)
    below: list[str] = []
    stalls: list[tuple[str, str]] = []
    router = router_object_name(pipeline.name)
    wanted: list[tuple[str, str, int, Sequence[ObservedPod]]] = [
        (
            f"stage {stage.name}",
            stage_deployment_name(pipeline.name, worker, update_revision),
            stage_minimum(stage),
            [p for p in pods if p.stage == worker and p.revision == update_revision],
        )
        for stage in pipeline.stages
        for worker in (worker_name(pipeline, stage.name),)
    ]
    wanted.append(
        (
            "router",
            router,
            pipeline.router.replicas,
            [p for p in pods if p.component == c.COMPONENT_ROUTER],
        )
    )
    for what, deployment, minimum, mine in wanted:
        ready = ready_replicas.get(deployment)
        if ready is not None and ready >= minimum:
            continue
        below.append(f"{what} ({0 if ready is None else ready}/{minimum} ready)")
        for pod in mine:
            trouble = pod_trouble(pod, now, policy)
            if trouble is not None:
                stalls.append((trouble[0], f"{what}: {trouble[1]}"))
                break
    if fetch_stall is not None:
        stalls.insert(0, fetch_stall)
    if stalls:
        reason = stalls[0][0]
        message = "; ".join(m for _, m in stalls)
        return Progress(
            (ConditionStatus.FALSE, "Stalled", "stalled: see the Stalled condition"),
            (ConditionStatus.TRUE, reason, message),
        )
    not_stalled = (ConditionStatus.FALSE, "NotStalled", "nothing blocks the spec")
    if weights is not None and weights[0] is not ConditionStatus.TRUE:
        return Progress((ConditionStatus.TRUE, "FetchingWeights", weights[2]), not_stalled)
    if rolling_out:
        return Progress(
            (ConditionStatus.TRUE, "RollingOut", f"revision {update_revision} rolls out"),
            not_stalled,
        )
    if below:
        return Progress(
            (ConditionStatus.TRUE, "StageBelowMinimum", "below minimum: " + "; ".join(below)),
            not_stalled,
        )
    return Progress(
        (ConditionStatus.FALSE, "Reconciled", f"revision {update_revision} is what the spec asks"),
        not_stalled,
    )
