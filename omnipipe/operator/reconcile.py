"""One reconcile: resolve -> build -> apply -> prune -> status. Idempotent, so a killed
and restarted operator converges to the same children."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnipipe.api import parse_resource
from omnipipe.api.names import stage_deployment_name, stage_object_name
from omnipipe.api.placement import worker_name
from omnipipe.api.status import Condition, ConditionStatus, OmniPipelineStatus, StageStatus
from omnipipe.api.weights import MODEL_CACHED
from omnipipe.operator.builders import (
    BuildContext,
    build_children,
    build_context,
    build_credential_secret,
    cached_models,
    fetch_job_for,
    router_endpoint,
    waits_for_weights,
)
from omnipipe.operator.k8s import Kube, utc_now
from omnipipe.operator.metrics import OperatorMetrics
from omnipipe.operator.planner import (
    ObservedDeployment,
    Rollout,
    child_key,
    initial_replicas,
    orphans,
    plan_rollout,
    revision_children,
)
from omnipipe.operator.settings import OperatorSettings
from omnipipe.operator.stall import ObservedPod
from omnipipe.operator.stall_events import stall_event
from omnipipe.operator.status_rollup import compute_status
from omnipipe.operator.uninstalled import uninstalled_pipeline_type, uninstalled_status
from omnipipe.operator.weights_status import ObservedFetch, fetch_stall, model_cached

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcileResult:
    created: tuple[str, ...]
    updated: tuple[str, ...]
    deleted: tuple[str, ...]
    ready: bool


def _label(key: tuple[str, str]) -> str:
    return f"{key[0]}/{key[1]}"


def _previous_conditions(body: Mapping[str, Any]) -> list[Condition]:
    raw = (body.get("status") or {}).get("conditions") or []
    return [Condition.model_validate(c) for c in raw]


def previous_stages(body: Mapping[str, Any]) -> list[StageStatus]:
    raw = (body.get("status") or {}).get("stages") or []
    return [StageStatus.model_validate(s) for s in raw]


CREDENTIAL_BYTES = 32


async def ensure_credential(kube: Kube, ctx: BuildContext) -> str | None:
    """Create the pipeline's credential Secret with a fresh random value unless it
    exists; an existing one is never read or rewritten, so no reconcile rotates it. The
    value drawn for an attempt that finds the Secret is dropped unseen. Returns the
    created Secret's child label, None when it existed."""
    secret = build_credential_secret(ctx, secrets.token_urlsafe(CREDENTIAL_BYTES))
    if await kube.create_secret_once(secret):
        return _label(("Secret", secret["metadata"]["name"]))
    return None


async def reconcile(
    kube: Kube, settings: OperatorSettings, body: Mapping[str, Any], metrics: OperatorMetrics
) -> ReconcileResult:
    if await _stalled_on_pipeline_type(kube, body, body.get("metadata", {}).get("generation")):
        return ReconcileResult((), (), (), False)
    resource = parse_resource(dict(body))
    meta = resource.metadata
    existing = {child_key(o): o for o in await kube.list_children(meta.namespace, meta.name)}
    ctx = build_context(resource, settings, fetched=_fetched(existing))
    desired = build_children(ctx)
    created: list[str] = []
    # Before the pods that read it, so none waits on a missing Secret.
    if (secret := await ensure_credential(kube, ctx)) is not None:
        created.append(secret)
    updated: list[str] = []
    for manifest in desired:
        key = child_key(manifest)
        before = existing.get(key)
        if key[0] == "Job" and before is not None:
            # A Job's pod template cannot change; its name covers what it fetches.
            continue
        applied = await kube.apply(manifest)
        if before is None:
            created.append(_label(key))
        elif before["metadata"].get("resourceVersion") != applied["metadata"].get(
            "resourceVersion"
        ):
            updated.append(_label(key))
    await _start_from_serving_counts(kube, body, ctx, existing, created)
    deleted = orphans(existing, [*(child_key(m) for m in desired), *_held(ctx)], ctx.revision)
    for kind, name in deleted:
        await kube.delete(kind, ctx.namespace, name)
    for reason, items in (
        ("Created", created),
        ("Updated", updated),
        ("Deleted", [_label(k) for k in deleted]),
    ):
        if items:
            await kube.post_event(body, reason, f"{reason.lower()} {', '.join(items)}")
    # Status from a fresh read of the pipeline: the autoscaler may have written since
    # the snapshot this reconcile started from.
    status = await refresh_status(
        kube, settings, ctx.namespace, ctx.name, metrics, generation=resource.metadata.generation
    )
    ready = status is not None and status.conditions[0].status == "True"
    log.info(
        "reconciled %s/%s: +%d ~%d -%d ready=%s",
        ctx.namespace,
        ctx.name,
        len(created),
        len(updated),
        len(deleted),
        ready,
    )
    return ReconcileResult(tuple(created), tuple(updated), tuple(_label(k) for k in deleted), ready)


def _fetched(existing: Mapping[tuple[str, str], Mapping[str, Any]]) -> frozenset[str]:
    """Fetch Jobs that succeeded: their claims hold a complete model."""
    return frozenset(
        name
        for (kind, name), obj in existing.items()
        if kind == "Job" and ObservedFetch.from_manifests(obj, ()).succeeded
    )


def _held(ctx: BuildContext) -> list[tuple[str, str]]:
    """Workloads of stages waiting for new weights (a changed weights.revision or
    claim size): they keep serving from the old claim until the new one is filled,
    then roll; never pruned meanwhile."""
    held: list[tuple[str, str]] = []
    for stage in ctx.pipeline.stages:
        if waits_for_weights(ctx, stage):
            worker = worker_name(ctx.pipeline, stage.name)
            held.append(("Deployment", stage_deployment_name(ctx.name, worker, ctx.revision)))
            scaler = stage_object_name(ctx.name, stage.name)
            held += [("HorizontalPodAutoscaler", scaler), ("ScaledObject", scaler)]
    return held


def _job_of(pod: Mapping[str, Any]) -> str | None:
    labels = pod["metadata"].get("labels") or {}
    return labels.get("batch.kubernetes.io/job-name") or labels.get("job-name")


@dataclass(frozen=True)
class WeightsState:
    cached: tuple[ConditionStatus, str, str]
    stall: tuple[str, str] | None


async def _weights_state(kube: Kube, ctx: BuildContext) -> WeightsState | None:
    models = cached_models(ctx)
    if not models:
        return None
    jobs, pods = await kube.list_fetches(ctx.namespace, ctx.name)
    observed = {}
    for job in jobs:
        name = job["metadata"]["name"]
        mine = [p for p in pods if _job_of(p) == name]
        observed[name] = ObservedFetch.from_manifests(job, mine)
    expected = [(m, fetch_job_for(ctx, m)) for m in models]
    return WeightsState(
        model_cached(expected, observed, ctx.fetch_backoff_limit), fetch_stall(expected, observed)
    )


async def _announce_cache(
    kube: Kube, body: Mapping[str, Any], cached: tuple[ConditionStatus, str, str] | None
) -> None:
    """An Event each time ModelCached changes reason or detail: cached, or a fetch
    attempt failed (with its reason), or the Job gave up."""
    if cached is None:
        return
    status, reason, message = cached
    before = next((c for c in _previous_conditions(body) if c.type == MODEL_CACHED), None)
    if before is not None and (before.reason, before.message) == (reason, message):
        return
    if status is ConditionStatus.TRUE:
        await kube.post_event(body, "ModelCached", message)
    elif reason not in ("Fetching", "FetchPending"):  # progress, not a failure
        await kube.post_event(body, "FetchFailed", f"{reason}: {message}", "Warning")


async def _start_from_serving_counts(
    kube: Kube,
    body: Mapping[str, Any],
    ctx: BuildContext,
    existing: Mapping[tuple[str, str], Mapping[str, Any]],
    created: list[str],
) -> None:
    """A new revision's autoscaled Deployments were applied without replicas (the
    autoscaler owns them); set them through the scale subresource, as the autoscaler
    does, to what the serving revision runs now."""
    previous = (body.get("status") or {}).get("currentRevision")
    rollout = plan_rollout(
        ctx.pipeline,
        previous,
        [ObservedDeployment.from_manifest(o) for k, o in existing.items() if k[0] == "Deployment"],
    )
    new = [label.split("/", 1)[1] for label in created if label.startswith("Deployment/")]
    for name, replicas in initial_replicas(ctx.pipeline, rollout, new).items():
        await kube.set_replicas(ctx.namespace, name, replicas)


async def _advance_rollout(
    kube: Kube, body: Mapping[str, Any], namespace: str, rollout: Rollout
) -> None:
    """Retire what the rollout leaves behind and say what happened, once."""
    before = body.get("status") or {}
    serving = before.get("currentRevision")
    # Also when the new revision is ready at once (seen late, under load): its
    # RevisionSwitched must not come without the RolloutStarted before it.
    switched_at_once = serving not in (None, rollout.update) and not rollout.progressing
    if (rollout.progressing or switched_at_once) and before.get("updateRevision") != rollout.update:
        beside = rollout.current if rollout.progressing else serving
        await kube.post_event(
            body,
            "RolloutStarted",
            f"rolling out revision {rollout.update} beside revision {beside}; "
            "traffic switches once all its stages are ready",
        )
    previous = before.get("currentRevision")
    if previous is not None and previous != rollout.current:
        await kube.post_event(
            body,
            "RevisionSwitched",
            f"all {len(rollout.update_stages)} stages of revision {rollout.current} are "
            f"ready; requests now start on it instead of revision {previous}",
        )
    if not rollout.retire:
        return
    existing = {
        child_key(o): o for o in await kube.list_children(namespace, body["metadata"]["name"])
    }
    doomed = revision_children(existing, rollout.retire)
    for kind, name in doomed:
        await kube.delete(kind, namespace, name)
    if doomed:
        await kube.post_event(
            body,
            "RevisionRetired",
            f"deleted revision {', '.join(rollout.retire)} "
            f"({', '.join(f'{k}/{n}' for k, n in doomed)}); its workers finish their "
            "requests before they exit",
        )


async def refresh_status(
    kube: Kube,
    settings: OperatorSettings,
    namespace: str,
    name: str,
    metrics: OperatorMetrics,
    generation: int | None = None,
) -> OmniPipelineStatus | None:
    """Recompute status from the children and the pipeline as they are now (both read
    fresh), without re-applying anything. `generation`: what a reconcile just handled."""
    body = await kube.get_pipeline(namespace, name)
    if body is None or body.get("metadata", {}).get("deletionTimestamp"):
        metrics.forget(namespace, name)
        return None
    if await _stalled_on_pipeline_type(
        kube,
        body,
        generation
        if generation is not None
        else (body.get("status") or {}).get("observedGeneration"),
    ):
        return None
    resource = parse_resource(body)
    ctx = build_context(resource, settings)
    deployments = {
        d["metadata"]["name"]: ObservedDeployment.from_manifest(d)
        for d in await kube.list_deployments(namespace, name)
    }
    rollout = plan_rollout(
        ctx.pipeline, (body.get("status") or {}).get("currentRevision"), deployments.values()
    )
    await _advance_rollout(kube, body, namespace, rollout)
    weights = await _weights_state(kube, ctx)
    cached = weights.cached if weights is not None else None
    await _announce_cache(kube, body, cached)
    pods = [ObservedPod.from_manifest(p) for p in await kube.list_pods(namespace, name)]
    status = compute_status(
        ctx.pipeline,
        generation
        if generation is not None
        else (body.get("status") or {}).get("observedGeneration"),
        deployments,
        _previous_conditions(body),
        router_endpoint(ctx),
        utc_now(),
        previous_stages(body),
        rollout,
        cached,
        pods,
        weights.stall if weights is not None else None,
        settings.stall_policy,
    )
    # The series first: the patch's await yields to the event loop while /metrics is
    # served from its own thread, so a reader who has seen this status (Ready, say) must
    # not still scrape the counts of the one before it.
    metrics.observe_status(
        namespace,
        name,
        status,
        {s.name: s.autoscaling.max_replicas for s in ctx.pipeline.stages if s.autoscaling},
    )
    await _write_status(kube, body, status)
    return status


async def _stalled_on_pipeline_type(
    kube: Kube, body: Mapping[str, Any], generation: int | None
) -> bool:
    """Whether the pipeline's type is one no installed family registers; its status
    then says so (Stalled) and nothing is applied."""
    pipeline = uninstalled_pipeline_type(body)
    if pipeline is None:
        return False
    status = uninstalled_status(pipeline, generation, _previous_conditions(body), utc_now())
    # An earlier status's endpoint, revisions and stages go: they are not to stand beside
    # a Stalled that says nothing is served through them.
    await _write_status(kube, body, status, clear_the_rest=True)
    return True


async def _write_status(
    kube: Kube, body: Mapping[str, Any], computed: OmniPipelineStatus, clear_the_rest: bool = False
) -> None:
    """A merge patch of the computed status; clear_the_rest: the keys it lacks are sent as
    explicit nulls, so the patch removes them."""
    status = computed.model_dump(mode="json", by_alias=True, exclude_none=True)
    before = body.get("status") or {}
    if before == status:
        return
    cleared = {key: None for key in before if key not in status} if clear_the_rest else {}
    meta = body["metadata"]
    await kube.patch_status(meta["namespace"], meta["name"], {**cleared, **status})
    if (event := stall_event(before, computed)) is not None:
        reason, message, kind = event
        await kube.post_event(body, reason, message, kind)
