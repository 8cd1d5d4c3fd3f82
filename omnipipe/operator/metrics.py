"""The operator's own metrics, in a registry it owns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omnipipe.api.status import ConditionStatus, OmniPipelineStatus

# ModelCached reasons that are progress, not a failed attempt.
_FETCH_PROGRESS = frozenset({"Cached", "Fetching", "FetchPending"})


@dataclass(frozen=True)
class OperatorMetrics:
    registry: CollectorRegistry
    reconciles: Counter
    reconcile_errors: Counter
    reconcile_seconds: Histogram
    replicas_desired: Gauge
    replicas_ready: Gauge
    replicas_max: Gauge
    fetch_failing: Gauge
    stalled: Gauge
    scaling_decisions: Counter
    # (namespace, pipeline) -> the series set for it, so a deleted pipeline's go too.
    _series: dict[tuple[str, str], set[tuple[str, tuple[str, ...]]]] = field(default_factory=dict)

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
            replicas_max=Gauge(
                "omnipipe_stage_replicas_max",
                "An autoscaled stage's maxReplicas.",
                stage_labels,
                registry=registry,
            ),
            fetch_failing=Gauge(
                "omnipipe_weights_fetch_failing",
                "1 while the pipeline's model fetch has failed (retrying or given up), "
                "with the fetch's reason; absent otherwise.",
                ("namespace", "pipeline", "reason"),
                registry=registry,
            ),
            stalled=Gauge(
                "omnipipe_pipeline_stalled",
                "1 while the pipeline is Stalled, with the condition's reason; absent otherwise.",
                ("namespace", "pipeline", "reason"),
                registry=registry,
            ),
            scaling_decisions=Counter(
                "omnipipe_operator_scaling_decisions_total",
                "Autoscaler decisions by stage and reason.",
                (*stage_labels, "reason"),
                registry=registry,
            ),
        )

    def _gauges(self) -> dict[str, Gauge]:
        return {
            "desired": self.replicas_desired,
            "ready": self.replicas_ready,
            "max": self.replicas_max,
            "fetch": self.fetch_failing,
            "stalled": self.stalled,
        }

    def observe_status(
        self,
        namespace: str,
        pipeline: str,
        status: OmniPipelineStatus,
        max_replicas: Mapping[str, int] | None = None,
    ) -> None:
        """The pipeline's series as its status says now; series it no longer has (a
        removed stage, a cleared failure) go. max_replicas: autoscaled stage -> max."""
        wanted: dict[tuple[str, tuple[str, ...]], float] = {}
        for stage in status.stages:
            labels: tuple[str, ...] = (namespace, pipeline, stage.name)
            wanted[("desired", labels)] = stage.desired_replicas
            wanted[("ready", labels)] = stage.ready_replicas
            if max_replicas and stage.name in max_replicas:
                wanted[("max", labels)] = max_replicas[stage.name]
        conditions = {c.type: c for c in status.conditions}
        cached = conditions.get("ModelCached")
        if (
            cached
            and cached.status is not ConditionStatus.TRUE
            and cached.reason not in _FETCH_PROGRESS
        ):
            wanted[("fetch", (namespace, pipeline, cached.reason))] = 1
        stalled = conditions.get("Stalled")
        if stalled and stalled.status is ConditionStatus.TRUE:
            wanted[("stalled", (namespace, pipeline, stalled.reason))] = 1
        gauges = self._gauges()
        key = (namespace, pipeline)
        for gone in self._series.get(key, set()) - set(wanted):
            gauges[gone[0]].remove(*gone[1])
        for (name, labels), value in wanted.items():
            gauges[name].labels(*labels).set(value)
        self._series[key] = set(wanted)

    def forget(self, namespace: str, pipeline: str) -> None:
        """A deleted pipeline: its series go, so no alert fires on what is gone."""
        gauges = self._gauges()
        for name, labels in self._series.pop((namespace, pipeline), set()):
            gauges[name].remove(*labels)
