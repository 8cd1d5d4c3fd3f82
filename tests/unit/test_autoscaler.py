"""The scaling policy and its queries: pure, so every rule is pinned here."""

from __future__ import annotations

import math

import pytest

from omnipipe.api.stage_spec import Autoscaling, Metric
from omnipipe.operator.autoscaler.policy import Observation, Policy, Recommendation, decide
from omnipipe.operator.autoscaler.queries import SignalKind, signal_queries

TOTAL = Policy(
    SignalKind.TOTAL,
    target=2,
    min_replicas=1,
    max_replicas=10,
    max_step=4,
    tolerance=0.1,
    up_window=0,
    down_window=60,
)
LEVEL = Policy(
    SignalKind.LEVEL,
    target=1.0,
    min_replicas=1,
    max_replicas=10,
    max_step=4,
    tolerance=0.1,
    up_window=0,
    down_window=60,
)


def seen(
    value: float | None,
    age: float | None = 1.0,
    demand: float | None = 0.0,
    error: str | None = None,
) -> Observation:
    return Observation(value, age, demand, error)


def test_scales_up_to_total_over_target() -> None:
    d = decide(TOTAL, current=2, ready=2, seen=seen(9), history=(), now=100, max_age=30)
    assert (d.desired, d.reason, d.active) == (5, "ScaleUp", True)
    assert "recommends 5" in d.message


def test_step_limit_and_bounds() -> None:
    d = decide(TOTAL, current=1, ready=1, seen=seen(40), history=(), now=0, max_age=30)
    assert d.desired == 5  # 1 + max_step 4, though 20 was asked for
    d = decide(TOTAL, current=9, ready=9, seen=seen(40), history=(), now=0, max_age=30)
    assert d.desired == 10  # maxReplicas


@pytest.mark.parametrize("value", [3.7, 4.0, 4.3])
def test_within_tolerance_nothing_changes(value: float) -> None:
    # 2 replicas at target 2: per-replica 1.85..2.15 sits inside the 10% band.
    d = decide(TOTAL, current=2, ready=2, seen=seen(value), history=(), now=0, max_age=30)
    assert (d.desired, d.reason) == (2, "WithinTolerance")


def test_level_signal_uses_ratio_and_tolerance() -> None:
    assert decide(LEVEL, 2, 2, seen(1.05), (), 0, 30).desired == 2
    assert decide(LEVEL, 2, 2, seen(2.0), (), 0, 30).desired == 4
    assert decide(LEVEL, 4, 4, seen(0.5), (), 0, 30).reason == "ScaleDown"


def test_scale_down_waits_for_the_window() -> None:
    history: tuple[Recommendation, ...] = ()
    current, t = 4, 0.0
    # Load gone: every recommendation is the minimum, but 4 was recommended 50s ago.
    history = (Recommendation(-50, 4),)
    d = decide(TOTAL, current, current, seen(0), history, t, 30)
    assert (d.desired, d.reason) == (4, "Stabilizing")
    d = decide(TOTAL, current, current, seen(0), d.history, t + 11, 30)
    assert d.desired == 1  # the 4 fell out of the 60s window


def test_scale_up_window_takes_the_lowest_recommendation() -> None:
    policy = Policy(SignalKind.TOTAL, 2, 1, 10, 10, 0.1, up_window=30, down_window=60)
    history = (Recommendation(-10, 2),)
    d = decide(policy, current=2, ready=2, seen=seen(16), history=history, now=0, max_age=30)
    assert (d.desired, d.reason) == (2, "Stabilizing")


@pytest.mark.parametrize(
    ("obs", "reason"),
    [
        (seen(None), "MetricMissing"),
        (seen(math.nan), "MetricMissing"),
        (seen(50, age=120), "MetricStale"),
        (seen(50, error="connection refused"), "PrometheusUnavailable"),
    ],
)
def test_bad_data_holds_the_count(obs: Observation, reason: str) -> None:
    d = decide(TOTAL, current=3, ready=3, seen=obs, history=(), now=0, max_age=30)
    assert (d.desired, d.active, d.reason) == (3, False, reason)


@pytest.mark.parametrize(
    "obs", [seen(None), seen(50, age=120), seen(50, error="connection refused"), seen(2)]
)
def test_the_bounds_need_no_data(obs: Observation) -> None:
    """A new Deployment starts at 1 replica: with minReplicas 2 and no usable signal it
    would sit below its minimum (Reconciling, to Flux) for as long as the signal is gone."""
    two = Policy(SignalKind.TOTAL, 2, 2, 4, 4, 0.1, 0, 60)
    d = decide(two, current=1, ready=1, seen=obs, history=(), now=0, max_age=30)
    assert (d.desired, d.reason) == (2, "BelowMinimum")
    d = decide(two, current=6, ready=6, seen=obs, history=(), now=0, max_age=30)
    assert (d.desired, d.reason) == (4, "AboveMaximum")


def test_scale_to_zero_and_wake_on_demand() -> None:
    zero = Policy(SignalKind.TOTAL, 2, 0, 4, 4, 0.1, 0, 0)
    assert decide(zero, 2, 2, seen(0), (), 0, 30).desired == 0
    asleep = decide(zero, 0, 0, seen(None, demand=0), (), 0, 30)
    assert (asleep.desired, asleep.reason, asleep.active) == (0, "ScaledToZero", True)
    woken = decide(zero, 0, 0, seen(None, demand=3), (), 0, 30)
    assert (woken.desired, woken.reason) == (1, "WakeOnDemand")
    unknown = decide(zero, 0, 0, seen(None, demand=None), (), 0, 30)
    assert (unknown.desired, unknown.active) == (0, False)


def test_a_woken_stage_waits_out_its_down_window_once_its_signal_is_back() -> None:
    """Woken at t=0, its pod's series absent while it starts (t=3), then the held request
    served between two scrapes: the signal reads 0 from t=4, yet the stage stays up
    until its 5 s down window has passed since the last held count."""
    zero = Policy(SignalKind.TOTAL, 1, 0, 1, 1, 0.1, up_window=0, down_window=5)
    woken = decide(zero, 0, 0, seen(None, demand=1), (), 0, 30)
    starting = decide(zero, 1, 0, seen(None, demand=1), woken.history, 3, 30)
    assert (starting.desired, starting.reason) == (1, "MetricMissing")
    back = decide(zero, 1, 1, seen(0, demand=0), starting.history, 4, 30)
    assert (back.desired, back.reason) == (1, "Stabilizing")
    later = decide(zero, 1, 1, seen(0, demand=0), back.history, 9, 30)
    assert (later.desired, later.reason) == (0, "ScaleDown")


def test_requests_the_router_holds_keep_a_running_stage_up() -> None:
    zero = Policy(SignalKind.TOTAL, 1, 0, 2, 2, 0.1, up_window=0, down_window=0)
    held = decide(zero, 1, 1, seen(0, demand=2), (), 0, 30)
    assert held.desired == 1
    assert decide(zero, 1, 1, seen(0, demand=0), (), 0, 30).desired == 0


def test_queries_select_the_stage_and_pick_the_signal_kind() -> None:
    inflight = signal_queries("ns", "p", "denoise", Autoscaling(max_replicas=3))
    assert inflight.kind is SignalKind.TOTAL
    assert (
        'omnipipe_stage_requests_waiting{namespace="ns",pipeline="p",stage="denoise"}'
        in inflight.value
    )
    assert inflight.age is not None
    assert "timestamp(" in inflight.age
    p90 = signal_queries("ns", "p", "s", Autoscaling(max_replicas=3, metric=Metric.QUEUE_WAIT_P90))
    assert p90.kind is SignalKind.LEVEL
    assert "histogram_quantile(0.9" in p90.value
    kv = signal_queries(
        "ns", "p", "thinker", Autoscaling(max_replicas=3, metric=Metric.KV_CACHE_USAGE)
    )
    # vLLM's gauge, as the worker re-exports it with the stage's labels.
    assert kv.value == 'avg(vllm:kv_cache_usage_perc{namespace="ns",pipeline="p",stage="thinker"})'
    jobs = signal_queries(
        "ns", "v", "denoise", Autoscaling(max_replicas=3, metric=Metric.VIDEO_JOBS)
    )
    every = 'omnipipe_router_video_jobs{namespace="ns",pipeline="v"}'
    assert jobs.kind is SignalKind.TOTAL
    assert jobs.value == f"sum(max by (status) ({every}))"
    assert jobs.demand.endswith(f" + sum(max by (status) ({every}))")
    audio = signal_queries(
        "ns", "t", "talker", Autoscaling(max_replicas=3, metric=Metric.FIRST_AUDIO_P90)
    )
    assert audio.kind is SignalKind.LEVEL
    assert audio.value == (
        "histogram_quantile(0.9, sum by (le) (rate(omnipipe_stage_time_to_first_audio_seconds"
        '_bucket{namespace="ns",pipeline="t",stage="talker"}[1m])))'
    )
    raw = signal_queries(
        "ns", "p", "s", Autoscaling(max_replicas=3, metric=Metric.PROMQL, query="vector(1)")
    )
    assert (raw.value, raw.age) == ("vector(1)", None)
    assert "omnipipe_router_pending_requests" in raw.demand


def test_a_rejected_query_is_reported_as_such() -> None:
    obs = Observation(None, None, None, "Prometheus rejected 'x'", "QueryRejected")
    d = decide(LEVEL, current=2, ready=2, seen=obs, history=(), now=0, max_age=30)
    assert (d.desired, d.active, d.reason) == (2, False, "QueryRejected")
