"""PromQL for each scaling signal. Pure: strings in, strings out."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from omnipipe.api.stage_spec import Autoscaling, Metric


class SignalKind(StrEnum):
    # Total demand over the stage; desired = ceil(total / target).
    TOTAL = "total"
    # A per-replica level; desired = ceil(current * value / target).
    LEVEL = "level"


@dataclass(frozen=True)
class SignalQueries:
    kind: SignalKind
    value: str
    # Seconds since the newest sample behind `value`; None where the signal is computed
    # over a range and carries its own freshness.
    age: str | None
    # Demand the router sees for a stage with no replica (scale from zero).
    demand: str


def _selector(namespace: str, pipeline: str, stage: str) -> str:
    return f'namespace="{namespace}",pipeline="{pipeline}",stage="{stage}"'


def signal_queries(namespace: str, pipeline: str, stage: str, policy: Autoscaling) -> SignalQueries:
    sel = _selector(namespace, pipeline, stage)
    demand = f"sum(omnipipe_router_pending_requests{{{sel}}})"
    if policy.metric is Metric.INFLIGHT:
        return SignalQueries(
            SignalKind.TOTAL,
            f"sum(omnipipe_stage_requests_running{{{sel}}}) "
            f"+ sum(omnipipe_stage_requests_waiting{{{sel}}})",
            f"time() - max(timestamp(omnipipe_stage_requests_running{{{sel}}}))",
            demand,
        )
    if policy.metric is Metric.QUEUE_WAIT_P90:
        return SignalQueries(
            SignalKind.LEVEL,
            "histogram_quantile(0.9, sum by (le) "
            f"(rate(omnipipe_stage_queue_wait_seconds_bucket{{{sel}}}[1m])))",
            f"time() - max(timestamp(omnipipe_stage_requests_running{{{sel}}}))",
            demand,
        )
    if policy.metric is Metric.FIRST_AUDIO_P90:
        return SignalQueries(
            SignalKind.LEVEL,
            "histogram_quantile(0.9, sum by (le) "
            f"(rate(omnipipe_stage_time_to_first_audio_seconds_bucket{{{sel}}}[1m])))",
            f"time() - max(timestamp(omnipipe_stage_requests_running{{{sel}}}))",
            demand,
        )
    if policy.metric is Metric.KV_CACHE_USAGE:
        # vLLM's own gauge, which the worker re-exports with pipeline and stage labels.
        return SignalQueries(
            SignalKind.LEVEL,
            f"avg(vllm:kv_cache_usage_perc{{{sel}}})",
            f"time() - max(timestamp(vllm:kv_cache_usage_perc{{{sel}}}))",
            demand,
        )
    if policy.metric is Metric.VIDEO_JOBS:
        jobs = f'omnipipe_router_video_jobs{{namespace="{namespace}",pipeline="{pipeline}"}}'
        # Every router replica publishes the counts of the store they share: one
        # replica's count per status is the total. Queued jobs wake a stage at zero.
        total = f"sum(max by (status) ({jobs}))"
        return SignalQueries(
            SignalKind.TOTAL, total, f"time() - max(timestamp({jobs}))", f"{demand} + {total}"
        )
    assert policy.query is not None  # the spec requires it for promql
    return SignalQueries(SignalKind.LEVEL, policy.query, None, demand)
