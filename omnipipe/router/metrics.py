"""Router metrics, in a registry owned by the app."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True)
class RouterMetrics:
    registry: CollectorRegistry
    requests: Counter
    duration: Histogram
    pending: Gauge
    video_jobs: Gauge
    video_job_age: Gauge

    @classmethod
    def create(cls) -> RouterMetrics:
        registry = CollectorRegistry()
        return cls(
            registry=registry,
            requests=Counter(
                "omnipipe_router_requests_total",
                "Requests by route and status.",
                ("pipeline", "route", "code"),
                registry=registry,
            ),
            duration=Histogram(
                "omnipipe_router_request_duration_seconds",
                "End-to-end latency.",
                ("pipeline", "route"),
                registry=registry,
                buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            ),
            pending=Gauge(
                "omnipipe_router_pending_requests",
                "Requests held because a stage has no ready replica: the wake-up signal "
                "for a stage scaled to zero.",
                ("pipeline", "stage"),
                registry=registry,
            ),
            video_jobs=Gauge(
                "omnipipe_router_video_jobs",
                "Video jobs not finished, by status (queued, in_progress), as the store "
                "shared by every router replica holds them: what the denoiser scales on.",
                ("pipeline", "status"),
                registry=registry,
            ),
            video_job_age=Gauge(
                "omnipipe_router_video_oldest_job_seconds",
                "Age of the oldest video job not finished, by status.",
                ("pipeline", "status"),
                registry=registry,
            ),
        )
