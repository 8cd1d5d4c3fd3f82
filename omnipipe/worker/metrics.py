"""Worker metrics, in a registry owned by the worker (no process globals)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 5, 10)


class EngineMetrics(Collector):
    """The engine's own metrics, re-exported with the worker's pipeline and stage labels.

    vLLM registers its metrics (vllm:num_requests_running, vllm:kv_cache_usage_perc, token
    counters...) in prometheus_client's process-wide registry, labelled by model name only;
    the autoscaler selects by pipeline and stage, as for every other stage metric."""

    PREFIX = "vllm:"

    def __init__(self, pipeline: str, stage: str, source: CollectorRegistry = REGISTRY) -> None:
        self.labels = {"pipeline": pipeline, "stage": stage}
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if not family.name.startswith(self.PREFIX):
                continue
            relabelled = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                relabelled.add_sample(
                    sample.name,
                    {**sample.labels, **self.labels},
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )
            yield relabelled


@dataclass
class WorkerMetrics:
    registry: CollectorRegistry
    running: Gauge
    waiting: Gauge
    duration: Histogram
    transfer_bytes: Counter
    transfer_seconds: Histogram
    transfer_frames: Counter
    queue_wait: Histogram
    engine_duration: Histogram
    first_audio: Histogram
    real_time_factor: Histogram
    seconds_without_progress: Gauge
    denoise_steps: Counter
    local_handoffs: Counter
    local_handoff_bytes: Counter

    @classmethod
    def create(cls, pipeline: str, stage: str, engine_metrics: bool = True) -> WorkerMetrics:
        """engine_metrics: re-export vLLM's process-wide metrics as this stage's; in a
        colocated group only the vLLM stage does, or every member would claim them."""
        registry = CollectorRegistry()
        labels = ("pipeline", "stage")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        m = cls(
            registry=registry,
            running=gauge("omnipipe_stage_requests_running", "Requests executing in the engine."),
            seconds_without_progress=gauge(
                "omnipipe_stage_engine_seconds_without_progress",
                "How long the engine call now running has made no progress (0: idle or "
                "moving); past the worker's stall_seconds it reports not ready.",
            ),
            waiting=gauge(
                "omnipipe_stage_requests_waiting",
                "Requests accepted but not executing: waiting for inputs or an engine slot.",
            ),
            duration=Histogram(
                "omnipipe_stage_request_duration_seconds",
                "Time from submission to the stage's output being handed on.",
                labels,
                registry=registry,
                buckets=LATENCY_BUCKETS,
            ),
            transfer_bytes=Counter(
                "omnipipe_transfer_bytes_total",
                "Tensor bytes moved between stages.",
                (*labels, "direction"),
                registry=registry,
            ),
            transfer_seconds=Histogram(
                "omnipipe_transfer_duration_seconds",
                "Time to move one message between stages.",
                (*labels, "direction"),
                registry=registry,
                buckets=LATENCY_BUCKETS,
            ),
            transfer_frames=Counter(
                "omnipipe_transfer_frames_total",
                "Transport messages between stages: one per hand-off sent alone, one per "
                "batch of hand-offs to one destination (a streaming step's chunks).",
                (*labels, "direction"),
                registry=registry,
            ),
            queue_wait=Histogram(
                "omnipipe_stage_queue_wait_seconds",
                "Time a request with all its inputs waited for the engine.",
                labels,
                registry=registry,
                buckets=LATENCY_BUCKETS,
            ),
            engine_duration=Histogram(
                "omnipipe_stage_engine_duration_seconds",
                "Time a request spent in the engine, from leaving the queue to its result "
                "(a streamed request: to its last chunk).",
                labels,
                registry=registry,
                buckets=LATENCY_BUCKETS,
            ),
            first_audio=Histogram(
                "omnipipe_stage_time_to_first_audio_seconds",
                "Time from submission to the stage's first chunk of audio (codes or samples).",
                labels,
                registry=registry,
                buckets=LATENCY_BUCKETS,
            ),
            denoise_steps=Counter(
                "omnipipe_stage_denoise_steps_total",
                "Denoising steps of requests: kind computed ran the whole transformer, "
                "kind reused took its blocks' output from the step cache (acceleration).",
                (*labels, "kind"),
                registry=registry,
            ),
            real_time_factor=Histogram(
                "omnipipe_stage_real_time_factor",
                "Engine seconds spent per second of audio produced, per request (<1 is "
                "faster than real time).",
                labels,
                registry=registry,
                buckets=RTF_BUCKETS,
            ),
            local_handoffs=Counter(
                "omnipipe_transfer_local_handoffs_total",
                "Hand-offs sent to a stage in the same process (a colocated group): by "
                "reference, through no socket; the transfer_* series count the others.",
                labels,
                registry=registry,
            ),
            local_handoff_bytes=Counter(
                "omnipipe_transfer_local_handoff_bytes_total",
                "Bytes of the tensors handed by reference to a stage in the same process.",
                labels,
                registry=registry,
            ),
        )
        if engine_metrics:
            registry.register(EngineMetrics(pipeline, stage))
        m._labels = (pipeline, stage)
        # Export every series from the start: an idle worker must read as 0, not absent.
        m.set_load(0, 0)
        m.seconds_without_progress.labels(pipeline, stage).set(0)
        m.duration.labels(pipeline, stage)
        m.queue_wait.labels(pipeline, stage)
        m.engine_duration.labels(pipeline, stage)
        for direction in ("in", "out"):
            # Else a pod's first hand-off creates the series, and rate() never counts it.
            m.transfer_bytes.labels(pipeline, stage, direction)
            m.transfer_seconds.labels(pipeline, stage, direction)
            m.transfer_frames.labels(pipeline, stage, direction)
        m.first_audio.labels(pipeline, stage)
        m.real_time_factor.labels(pipeline, stage)
        m.local_handoffs.labels(pipeline, stage)
        m.local_handoff_bytes.labels(pipeline, stage)
        return m

    _labels: tuple[str, str] = ("", "")

    @property
    def labels(self) -> tuple[str, str]:
        return self._labels

    def transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(*self._labels, direction).inc(nbytes)
        self.transfer_seconds.labels(*self._labels, direction).observe(seconds)

    def count_local_handoff(self, nbytes: int) -> None:
        self.local_handoffs.labels(*self._labels).inc()
        self.local_handoff_bytes.labels(*self._labels).inc(nbytes)

    def count_frame(self, direction: str) -> None:
        self.transfer_frames.labels(*self._labels, direction).inc()

    def count_steps(self, kind: str, n: int) -> None:
        self.denoise_steps.labels(*self._labels, kind).inc(n)

    def set_load(self, running: int, waiting: int) -> None:
        self.running.labels(*self._labels).set(running)
        self.waiting.labels(*self._labels).set(waiting)

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.labels(*self._labels).observe(seconds)

    def observe_engine(self, seconds: float) -> None:
        self.engine_duration.labels(*self._labels).observe(seconds)

    def observe_duration(self, seconds: float) -> None:
        self.duration.labels(*self._labels).observe(seconds)

    def observe_first_audio(self, seconds: float) -> None:
        self.first_audio.labels(*self._labels).observe(seconds)

    def observe_real_time_factor(self, ratio: float) -> None:
        self.real_time_factor.labels(*self._labels).observe(ratio)


class MergedMetrics(Collector):
    """Several stages' registries as one exposition (a colocated group's /metrics): a
    family appears once, with every member's samples, each keeping its stage label."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                into = merged.setdefault(
                    family.name,
                    Metric(family.name, family.documentation, family.type, family.unit),
                )
                into.samples.extend(family.samples)
        yield from merged.values()
