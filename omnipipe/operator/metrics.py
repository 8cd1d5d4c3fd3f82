"""The operator's own metrics, in a registry it owns."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omnipipe.api.status import OmniPipelineStatus


@dataclass(frozen=True)
class OperatorMetrics:
    registry: CollectorRegistry
    reconciles: Counter
    reconcile_errors: Counter
    reconcile_seconds: Histogram
    replicas_desired: Gauge
    replicas_ready: Gauge
    scaling_decisions: Counter

    @classmethod
    def create(cls) -> OperatorMetrics:
        registry = CollectorRegistry()
        stage_labels = ("namespace", "pipeline", "stage")
        return cls(
            registry=registry,
            reconciles=Counter(
                "omnipipe_operator_reconcile_total",
                "Reconciles by trigger and result.",
                ("trigger", "result"),
                registry=registry,
            ),
            reconcile_errors=Counter(
                "omnipipe_operator_reconcile_errors_total",
                "Reconciles that raised, by error type.",
                ("error",),
                registry=registry,
            ),
            reconcile_seconds=Histogram(
                "omnipipe_operator_reconcile_duration_seconds",
                "Time one reconcile took.",
                ("trigger",),
                registry=registry,
                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            ),
            replicas_desired=Gauge(
                "omnipipe_stage_replicas_desired",
                "Replicas a stage's Deployment wants.",
                stage_labels,
                registry=registry,
            ),
            replicas_ready=Gauge(
                "omnipipe_stage_replicas_ready",
                "Ready replicas of a stage's Deployment.",
                stage_labels,
                registry=registry,
            ),
            scaling_decisions=Counter(
                "omnipipe_operator_scaling_decisions_total",
                "Autoscaler decisions by stage and reason.",
                (*stage_labels, "reason"),
                registry=registry,
            ),
        )

    def observe_status(self, namespace: str, pipeline: str, status: OmniPipelineStatus) -> None:
        for stage in status.stages:
            labels = (namespace, pipeline, stage.name)
            self.replicas_desired.labels(*labels).set(stage.desired_replicas)
            self.replicas_ready.labels(*labels).set(stage.ready_replicas)
