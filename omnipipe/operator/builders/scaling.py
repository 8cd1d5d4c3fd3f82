"""For stages with autoscaling.mode keda or hpa: the object that scales them instead of
the operator's own loop. Same signal, target, bounds, windows and step."""

from __future__ import annotations

from omnipipe.api import ResolvedStage
from omnipipe.api.names import stage_deployment_name, stage_labels, stage_object_name
from omnipipe.api.stage_spec import ScalingMode
from omnipipe.operator.autoscaler.queries import SignalKind, signal_queries
from omnipipe.operator.builders.common import Manifest, object_meta
from omnipipe.operator.builders.context import BuildContext

# The external metric name a prometheus-adapter rule exposes for the hpa mode.
EXTERNAL_METRIC = "omnipipe_stage_signal"
SYNC_SECONDS = 15


def _behavior(stage: ResolvedStage) -> Manifest:
    scaling = stage.autoscaling
    assert scaling is not None
    step = [{"type": "Pods", "value": scaling.max_step, "periodSeconds": SYNC_SECONDS}]
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": scaling.scale_up_stabilization_seconds,
            "policies": step,
        },
        "scaleDown": {
            "stabilizationWindowSeconds": scaling.scale_down_stabilization_seconds,
            "policies": step,
        },
    }


def _target(stage: ResolvedStage) -> str:
    return f"{stage.target:g}"


def build_scaled_object(ctx: BuildContext, stage: ResolvedStage, prometheus_url: str) -> Manifest:
    scaling = stage.autoscaling
    assert scaling is not None
    name = stage_object_name(ctx.name, stage.name)
    # The update revision's Deployment: an old revision keeps its count until it goes.
    target = stage_deployment_name(ctx.name, stage.name, ctx.revision)
    queries = signal_queries(ctx.namespace, ctx.name, stage.name, scaling)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": object_meta(ctx, name, stage_labels(ctx.name, stage.name)),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": SYNC_SECONDS,
            "cooldownPeriod": max(scaling.scale_down_stabilization_seconds, 30),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(stage)}},
            "triggers": [
                {
                    "type": "prometheus",
                    # A total demand is divided across replicas; a level is compared as is.
                    "metricType": "AverageValue" if queries.kind is SignalKind.TOTAL else "Value",
                    "metadata": {
                        "serverAddress": prometheus_url,
                        "query": queries.value,
                        "threshold": _target(stage),
                    },
                }
            ],
        },
    }


def build_hpa(ctx: BuildContext, stage: ResolvedStage) -> Manifest:
    scaling = stage.autoscaling
    assert scaling is not None
    name = stage_object_name(ctx.name, stage.name)
    # The update revision's Deployment: an old revision keeps its count until it goes.
    deployment = stage_deployment_name(ctx.name, stage.name, ctx.revision)
    kind = signal_queries(ctx.namespace, ctx.name, stage.name, scaling).kind
    target: Manifest = (
        {"type": "AverageValue", "averageValue": _target(stage)}
        if kind is SignalKind.TOTAL
        else {"type": "Value", "value": _target(stage)}
    )
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_meta(ctx, name, stage_labels(ctx.name, stage.name)),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
            # An HPA cannot go below one replica without the HPAScaleToZero gate.
            "minReplicas": max(1, scaling.min_replicas),
            "maxReplicas": scaling.max_replicas,
            "behavior": _behavior(stage),
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": EXTERNAL_METRIC,
                            "selector": {
                                "matchLabels": {
                                    "namespace": ctx.namespace,
                                    "pipeline": ctx.name,
                                    "stage": stage.name,
                                    "signal": scaling.metric.value,
                                }
                            },
                        },
                        "target": target,
                    },
                }
            ],
        },
    }


def build_scaler(ctx: BuildContext, stage: ResolvedStage) -> Manifest | None:
    if stage.autoscaling is None or stage.autoscaling.mode is ScalingMode.NATIVE:
        return None
    if stage.autoscaling.mode is ScalingMode.KEDA:
        return build_scaled_object(ctx, stage, ctx.prometheus_url)
    return build_hpa(ctx, stage)
