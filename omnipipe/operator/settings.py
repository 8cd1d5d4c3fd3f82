"""Operator settings, loaded once from OMNIPIPE_OPERATOR_* environment variables."""

from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict

from omnipipe import __version__
from omnipipe.operator.stall import StallPolicy


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="OMNIPIPE_OPERATOR_", frozen=True, use_attribute_docstrings=True
    )

    worker_image: str = f"omnipipe/worker:{__version__}"
    """Default image of stage workers (spec.images.worker overrides it)."""
    router_image: str = f"omnipipe/router:{__version__}"
    """Default image of the router (spec.images.router overrides it)."""
    video_store: str | None = None
    """The Redis (redis://host:6379/0) that the routers of video pipelines keep their
    jobs in, shared by each pipeline's router replicas; a video pipeline's router does not
    start without one."""
    image_pull_policy: str = "IfNotPresent"
    """imagePullPolicy of every container the operator creates."""
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    """Prometheus the autoscaler queries unless a pipeline sets spec.prometheusUrl."""
    drift_check_seconds: float = 60.0
    """How often every pipeline is re-applied to undo manual drift of its children."""
    termination_grace_seconds: int = 120
    """terminationGracePeriodSeconds of worker pods: the bound on draining in-flight work."""
    namespace: str | None = None
    """Watch only this namespace; all namespaces when unset."""
    peering: str | None = None
    """kopf peering name (a ClusterKopfPeering): replicas of the operator elect one active
    instance. Unset runs standalone, for a single replica."""
    autoscale_interval_seconds: float = 15.0
    """How often autoscaled stages are evaluated (Kubernetes' HPA syncs every 15 s)."""
    metric_max_age_seconds: float = 60.0
    """A signal whose newest sample is older than this is stale: replicas are held."""
    status_refresh_delay_seconds: float = 0.25
    """How long a Deployment event waits before the pipeline's status is recomputed, so
    the burst it belongs to (each stage's Deployment reports several changes as it rolls
    out) costs one read and one write, not one per event."""
    stage_network_policy: bool = True
    """Emit a NetworkPolicy per pipeline that admits to its stage pods only: its router
    pods on the control port, its stage pods on the transfer port, and the metrics
    scrapers below on the control port."""
    metrics_scrape_from: list[dict[str, Any]] = [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    """NetworkPolicy peers allowed to scrape /metrics on the stage pods' control port (as
    JSON in the environment). Empty: none."""
    fetch_backoff_limit: int = 6
    """backoffLimit of the Jobs that fill model caches (weights.source cache): failed
    fetches retried, with the Job controller's exponential back-off, before it gives up."""
    crash_loop_restarts: int = 3
    """Restarts after which a crash-looping pod of a stage below its minimum makes the
    pipeline Stalled (reason CrashLooping)."""
    unschedulable_seconds: float = 60.0
    """How long a pod of a stage below its minimum may wait for a node before the
    pipeline is Stalled (reason Unschedulable): a cluster autoscaler adds one sooner."""
    metrics_port: int = 8080
    """Port of the operator's Prometheus /metrics."""
    health_port: int = 8081
    """Port of kopf's liveness endpoint, /healthz."""

    @property
    def stall_policy(self) -> StallPolicy:
        return StallPolicy(self.crash_loop_restarts, self.unschedulable_seconds)
