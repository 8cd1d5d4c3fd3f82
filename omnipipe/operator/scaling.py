"""One autoscaling pass over a pipeline: query, decide (pure), scale, report.

The operator is the only writer of an autoscaled stage's replica count, through the
Deployment's scale subresource; the builders leave `replicas` out for such stages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from omnipipe.api import parse_resource, resolve
from omnipipe.api.names import stage_deployment_name
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.stage_spec import ScalingMode
from omnipipe.api.status import Condition, ConditionStatus
from omnipipe.operator.autoscaler.policy import (
    Decision,
    Observation,
    Policy,
    Recommendation,
    decide,
)
from omnipipe.operator.autoscaler.queries import SignalQueries, signal_queries
from omnipipe.operator.autoscaler.source import PrometheusSource
from omnipipe.operator.k8s import Kube, utc_now
from omnipipe.operator.metrics import OperatorMetrics
from omnipipe.operator.planner import ObservedDeployment
from omnipipe.operator.reconcile import previous_stages
from omnipipe.operator.settings import OperatorSettings
from omnipipe.operator.uninstalled import uninstalled_pipeline_type

log = logging.getLogger(__name__)
History = MutableMapping[str, tuple[Recommendation, ...]]


async def _observe(prom: PrometheusSource, url: str, queries: SignalQueries) -> Observation:
    value = await prom.query(url, queries.value)
    if value.error:
        return Observation(None, None, None, value.error, value.error_reason)
    age = await prom.query(url, queries.age) if queries.age else None
    demand = await prom.query(url, queries.demand)
    return Observation(
        value.value,
        age.value if age else None,
        demand.value if demand.error is None else None,
        demand.error,
    )


async def autoscale(
    kube: Kube,
    prom: PrometheusSource,
    settings: OperatorSettings,
    namespace: str,
    name: str,
    history: History,
    metrics: OperatorMetrics,
) -> None:
    # Read it fresh: a status write since the caller's snapshot must not be undone.
    body = await kube.get_pipeline(namespace, name)
    if body is None or body.get("metadata", {}).get("deletionTimestamp"):
        return
    if uninstalled_pipeline_type(body) is not None:
        return  # Stalled, said by reconcile; nothing of it to scale
    resource = parse_resource(body)
    pipeline = resolve(resource)
    url = resource.spec.prometheus_url or settings.prometheus_url
    stages = [
        s
        for s in pipeline.stages
        if s.autoscaling is not None and s.autoscaling.mode is ScalingMode.NATIVE
    ]
    if not stages:
        return
    deployments = {
        d["metadata"]["name"]: d
        for d in await kube.list_deployments(pipeline.namespace, pipeline.name)
    }
    status_stages = {s.name: s for s in previous_stages(body)}
    inactive: list[str] = []
    now_wall, now = utc_now(), time.monotonic()
    for stage in stages:
        assert stage.autoscaling is not None
        assert stage.target is not None
        # The update revision's: an older one keeps its count until it is retired.
        name = stage_deployment_name(pipeline.name, stage.name, pipeline_revision(pipeline))
        if name not in deployments:
            continue
        observed = ObservedDeployment.from_manifest(deployments[name])
        scaling = stage.autoscaling
        queries = signal_queries(pipeline.namespace, pipeline.name, stage.name, scaling)
        policy = Policy(
            kind=queries.kind,
            target=stage.target,
            min_replicas=scaling.min_replicas,
            max_replicas=scaling.max_replicas,
            max_step=scaling.max_step,
            tolerance=scaling.tolerance,
            up_window=scaling.scale_up_stabilization_seconds,
            down_window=scaling.scale_down_stabilization_seconds,
        )
        seen = await _observe(prom, url, queries)
        decision: Decision = decide(
            policy,
            observed.desired,
            observed.ready,
            seen,
            history.get(stage.name, ()),
            now,
            settings.metric_max_age_seconds,
        )
        history[stage.name] = decision.history
        metrics.scaling_decisions.labels(
            pipeline.namespace, pipeline.name, stage.name, decision.reason
        ).inc()
        if not decision.active:
            inactive.append(f"{stage.name}: {decision.reason}: {decision.message}")
        before = status_stages.get(stage.name)
        fields: dict[str, Any] = {
            "metric": scaling.metric.value,
            "metric_value": seen.value,
            "last_decision": decision.message,
            "last_decision_reason": decision.reason,
        }
        if decision.changed(observed.desired):
            await kube.set_replicas(pipeline.namespace, name, decision.desired)
            await kube.post_event(
                body,
                "Scaled",
                f"stage {stage.name}: {observed.desired} -> "
                f"{decision.desired} replicas ({decision.reason}): "
                f"{decision.message}",
            )
            log.info(
                "%s/%s %s: %s", pipeline.namespace, pipeline.name, stage.name, decision.message
            )
            fields["last_scale_time"] = now_wall
            fields["desired_replicas"] = decision.desired
        if before is not None:
            status_stages[stage.name] = before.model_copy(update=fields)
    await _write_scaling_status(kube, body, status_stages, inactive, now_wall)


async def _write_scaling_status(
    kube: Kube, body: Mapping[str, Any], stages: Mapping[str, Any], inactive: list[str], now: str
) -> None:
    status = dict(body.get("status") or {})
    old = [Condition.model_validate(c) for c in status.get("conditions") or []]
    previous = next((c for c in old if c.type == "ScalingActive"), None)
    state = ConditionStatus.FALSE if inactive else ConditionStatus.TRUE
    reason = inactive[0].split(": ")[1] if inactive else "ValidMetrics"
    message = "; ".join(inactive) if inactive else "every autoscaled stage has fresh data"
    if previous is not None and previous.status != state and inactive:
        await kube.post_event(body, "ScalingHeld", message, type_="Warning")
    condition = Condition(
        type="ScalingActive",
        status=state,
        reason=reason,
        message=message,
        last_transition_time=previous.last_transition_time
        if previous and previous.status == state
        else now,
        observed_generation=body.get("metadata", {}).get("generation"),
    )
    conditions = [c for c in old if c.type != "ScalingActive"] + [condition]
    new = {
        **status,
        "conditions": [
            c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in conditions
        ],
        "stages": [
            s.model_dump(mode="json", by_alias=True, exclude_none=True) for s in stages.values()
        ],
    }
    if new != status:
        meta = body["metadata"]
        await kube.patch_status(meta["namespace"], meta["name"], new)
