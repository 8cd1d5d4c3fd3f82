"""The worker re-exports the engine's own metrics with its pipeline and stage labels."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from omnipipe.worker.metrics import EngineMetrics, WorkerMetrics


def test_vllm_metrics_get_pipeline_and_stage_labels_and_others_stay_out() -> None:
    engine = CollectorRegistry()
    usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage.", ["model_name"], registry=engine)
    usage.labels("m").set(0.25)
    tokens = Counter("vllm:generation_tokens", "Tokens.", ["model_name"], registry=engine)
    tokens.labels("m").inc(7)
    Gauge("unrelated_gauge", "Not the engine's.", registry=engine).set(1)
    out = CollectorRegistry()
    out.register(EngineMetrics("p", "thinker", source=engine))
    text = generate_latest(out).decode()
    assert 'vllm:kv_cache_usage_perc{model_name="m",pipeline="p",stage="thinker"} 0.25' in text
    assert 'vllm:generation_tokens_total{model_name="m",pipeline="p",stage="thinker"} 7.0' in text
    assert "unrelated_gauge" not in text


def test_a_new_worker_exports_every_series_at_zero() -> None:
    """An idle or freshly woken worker reads as 0, not absent: a series created by its
    first event would never count that event in rate()."""
    text = generate_latest(WorkerMetrics.create("p", "s").registry).decode()
    for series in (
        'omnipipe_transfer_bytes_total{direction="in",pipeline="p",stage="s"} 0.0',
        'omnipipe_transfer_bytes_total{direction="out",pipeline="p",stage="s"} 0.0',
        'omnipipe_transfer_duration_seconds_count{direction="in",pipeline="p",stage="s"} 0.0',
        'omnipipe_transfer_duration_seconds_count{direction="out",pipeline="p",stage="s"} 0.0',
        'omnipipe_transfer_frames_total{direction="in",pipeline="p",stage="s"} 0.0',
        'omnipipe_transfer_frames_total{direction="out",pipeline="p",stage="s"} 0.0',
        'omnipipe_stage_engine_duration_seconds_count{pipeline="p",stage="s"} 0.0',
        'omnipipe_stage_queue_wait_seconds_count{pipeline="p",stage="s"} 0.0',
    ):
        assert series in text.splitlines(), series
