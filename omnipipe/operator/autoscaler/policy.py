"""The scaling decision, as a pure function of what was observed.

HPA semantics: a tolerance band around the target, the lowest recommendation of the
scale-up window and the highest of the scale-down window, a step limit, and bounds.
Missing, stale or unreachable data never moves the replica count, except into the
spec's bounds: those need no data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omnipipe.operator.autoscaler.queries import SignalKind


@dataclass(frozen=True)
class Policy:
    kind: SignalKind
    target: float
    min_replicas: int
    max_replicas: int
    max_step: int
    tolerance: float
    up_window: float
    down_window: float


@dataclass(frozen=True)
class Observation:
    value: float | None  # None: the series is absent
    age: float | None  # seconds since its newest sample, when known
    demand: float | None  # requests the router holds for this stage
    error: str | None = None  # the query failed
    error_reason: str = "PrometheusUnavailable"


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(frozen=True)
class Decision:
    desired: int
    active: bool  # False: data was unusable and the count is held
    reason: str
    message: str
    history: tuple[Recommendation, ...]

    def changed(self, current: int) -> bool:
        return self.desired != current


def _clamp(n: int, policy: Policy) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, n))


def recommend(policy: Policy, value: float, current: int, ready: int) -> int:
    """Replicas the signal asks for right now, before windows, steps and bounds."""
    if policy.kind is SignalKind.TOTAL:
        if current == 0 or ready == 0:
            return math.ceil(value / policy.target) if value > 0 else current
        if abs(value / ready / policy.target - 1) <= policy.tolerance:
            return current
        return math.ceil(value / policy.target)
    if abs(value / policy.target - 1) <= policy.tolerance:
        return current
    return math.ceil(max(ready, 1) * value / policy.target)


def decide(
    policy: Policy,
    current: int,
    ready: int,
    seen: Observation,
    history: tuple[Recommendation, ...],
    now: float,
    max_age: float,
) -> Decision:
    if current == 0:
        # No pods, so no stage metrics: only the router's held requests say "wake up".
        if seen.error is not None or seen.demand is None:
            return Decision(
                0, False, "DemandUnknown", seen.error or "router demand series absent", history
            )
        if seen.demand > 0:
            wake = _clamp(max(1, policy.min_replicas), policy)
            # Recorded, so the scale-down window counts from the wake.
            return Decision(
                wake,
                True,
                "WakeOnDemand",
                f"{seen.demand:g} request(s) waiting for a replica",
                (Recommendation(now, wake),),
            )
        target = _clamp(0, policy)
        return Decision(
            target,
            True,
            "ScaledToZero" if target == 0 else "BelowMinimum",
            "no demand" if target == 0 else f"raising to minReplicas {target}",
            (),
        )
    bounded = _clamp(current, policy)
    if bounded != current:
        # A new Deployment starts at 1, and a changed spec may move the bounds: neither
        # waits for a signal (without one, a stage would sit below its minimum forever).
        raising = bounded > current
        return Decision(
            bounded,
            True,
            "BelowMinimum" if raising else "AboveMaximum",
            f"{'raising to minReplicas' if raising else 'lowering to maxReplicas'} {bounded}",
            history,
        )
    horizon = max(policy.up_window, policy.down_window)

    def remembered(rec: int) -> tuple[Recommendation, ...]:
        return (*tuple(r for r in history if now - r.at <= horizon), Recommendation(now, rec))

    # A count held for want of data is remembered as a recommendation to keep it: when
    # the signal comes back (a woken stage's first pod, whose series is absent while it
    # starts), a scale-down still waits out its window from then.
    if seen.error is not None:
        return Decision(current, False, seen.error_reason, seen.error, remembered(current))
    if seen.value is None or math.isnan(seen.value):
        return Decision(
            current, False, "MetricMissing", "the signal's series is absent", remembered(current)
        )
    if seen.age is not None and seen.age > max_age:
        return Decision(
            current,
            False,
            "MetricStale",
            f"newest sample is {seen.age:.0f}s old (limit {max_age:.0f}s)",
            remembered(current),
        )

    raw = recommend(policy, seen.value, current, ready)
    rec = _clamp(raw, policy)
    if seen.demand and rec < current:
        # The router holds requests for this stage: they are not in its own signal yet.
        rec = current
    kept = remembered(rec)
    if rec > current:
        window = [r.replicas for r in kept if now - r.at <= policy.up_window]
        desired = min(max(min(window), current), current + policy.max_step)
        reason = "ScaleUp"
    elif rec < current:
        window = [r.replicas for r in kept if now - r.at <= policy.down_window]
        desired = max(min(max(window), current), current - policy.max_step)
        reason = "ScaleDown"
    else:
        desired, reason = current, "WithinTolerance"
    desired = _clamp(desired, policy)
    if desired == current and reason != "WithinTolerance":
        reason = "Stabilizing"
    per = f"{seen.value:g}" if policy.kind is SignalKind.LEVEL else f"{seen.value:g} total"
    message = (
        f"signal {per}, target {policy.target:g}: recommends {rec}, "
        f"{'keeps' if desired == current else 'sets'} {desired} (was {current})"
    )
    return Decision(desired, True, reason, message, kept)
