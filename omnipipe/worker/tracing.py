"""One request's spans in one stage, built once it ends from the times it passed each
point (wall-clock nanoseconds), so that tracing adds nothing to the engine's path.

Under the stage's span (a child of the router's, through the request's traceparent),
the phases tile it in order, each ending when the request passed its point:

    wait-upstream  submitted, until its first input began to arrive
    transfer-in    until its last input was taken (every upstream stage sent its last)
    queue          until the engine took it
    engine         until its result (a streamed request: until its last chunk)
    hand-off       until its output reached every downstream stage
    emit           until its results were queued on the router's event stream

A phase whose points were not reached (a first stage has no inputs; a failed request
stops early), or that was marked as no time at all (a streamed request hands off
between its engine steps), is left out. A streamed request's inputs arrive while it
runs: it has no wait-upstream or transfer-in phase.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from opentelemetry import trace

from omnipipe.api.tracing import is_valid, parent_context

SUBMITTED = "submitted"
FIRST_INPUT = "first_input"
INPUTS = "inputs"
QUEUED = "queued"
STARTED = "started"
ENGINE_DONE = "engine_done"
HANDED_OFF = "handed_off"
DONE = "done"

# Each phase: its name, and the marks it runs between.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("wait-upstream", SUBMITTED, FIRST_INPUT),
    ("transfer-in", FIRST_INPUT, INPUTS),
    ("queue", QUEUED, STARTED),
    ("engine", STARTED, ENGINE_DONE),
    ("hand-off", ENGINE_DONE, HANDED_OFF),
    ("emit", HANDED_OFF, DONE),
)


@dataclass
class Timeline:
    """When one request passed each point in this stage, and what it counted."""

    marks: dict[str, int] = field(default_factory=dict)
    attributes: dict[str, str | int | float] = field(default_factory=dict)

    def mark(self, point: str, at_ns: int | None = None) -> None:
        self.marks[point] = time.time_ns() if at_ns is None else at_ns

    def mark_first(self, point: str, at_ns: int) -> None:
        self.marks[point] = min(self.marks.get(point, at_ns), at_ns)

    def seconds(self, start: str, end: str) -> float | None:
        if start in self.marks and end in self.marks:
            return max(0, self.marks[end] - self.marks[start]) / 1e9
        return None


def _phases(marks: Mapping[str, int]) -> list[tuple[str, int, int]]:
    """The phases reached, each from where the previous one ended: they tile the stage's
    span with no gap and no overlap. So the moments between two phases count in the
    later one (a first stage's wait for its worker's loop to start it is queueing)."""
    spans: list[tuple[str, int, int]] = []
    cursor = marks[SUBMITTED]
    for name, start, end in PHASES:
        if start in marks and end in marks and marks[start] != marks[end]:
            finish = max(cursor, marks[end])
            # Inputs may arrive before the submission: then no time was spent waiting.
            if finish > cursor:
                spans.append((name, cursor, finish))
            cursor = finish
    return spans


def record_request(
    tracer: trace.Tracer,
    stage: str,
    request_id: str,
    traceparent: str,
    timeline: Timeline,
    error: str = "",
) -> None:
    """Exports the request's stage span and its phases (nothing unless the tracer
    samples it: the router's decision travels in the traceparent)."""
    marks = timeline.marks
    # No traceparent: the router traces nothing (or predates tracing), nor does the stage.
    if SUBMITTED not in marks or not is_valid(traceparent):
        return
    end = marks.get(DONE, time.time_ns())
    span = tracer.start_span(
        f"stage {stage}",
        context=parent_context(traceparent),
        kind=trace.SpanKind.SERVER,
        start_time=marks[SUBMITTED],
        attributes={"omnipipe.stage": stage, "omnipipe.request_id": request_id},
    )
    if not span.is_recording():
        return
    span.set_attributes(timeline.attributes)
    if error:
        span.set_status(trace.StatusCode.ERROR, error)
        span.set_attribute("omnipipe.error", error)
    context = trace.set_span_in_context(span)
    for name, begin, finish in _phases({**marks, DONE: end}):
        tracer.start_span(name, context=context, start_time=begin).end(end_time=finish)
    span.end(end_time=end)
