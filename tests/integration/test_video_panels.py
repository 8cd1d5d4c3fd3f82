"""The overview dashboard's video-job panels show live data: `omnipipe serve` of tiny://wan
(its router takes no jobs, so the ones made stay queued) scraped by Debian's Prometheus,
every target of those panels run as Grafana runs it. The real node runs no video pipeline
(its chart would need a Redis), so tests/realnode/test_telemetry.py leaves these panels
to this test."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from omnipipe.local.video_store import start_redis
from tests.e2e.conftest import start_serve, stop_cleanly
from tests.harness.live_panels import DASHBOARDS, VIDEO_PANELS, dashboard_png
from tests.harness.prometheus import Prometheus, prometheus

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
]

MANIFEST = """\
apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: panel-video}
spec:
  model: tiny://wan
  pipeline: wan
"""
NAMESPACE = "local"
SCRAPE = 1.0
QUEUED = 3


@pytest.fixture
def prom(tmp_path: Path) -> Iterator[Prometheus]:
    with prometheus(tmp_path / "prometheus") as p:
        yield p


def test_the_video_panels_show_the_queued_jobs(prom: Prometheus, tmp_path: Path) -> None:
    redis_proc, store = start_redis(tmp_path / "redis")
    manifest = tmp_path / "video.yaml"
    manifest.write_text(MANIFEST)
    served = start_serve(
        manifest,
        env={"OMNIPIPE_ROUTER_VIDEO_STORE": store, "OMNIPIPE_ROUTER_VIDEO_JOBS_PER_REPLICA": "0"},
    )
    try:
        # The router and every stage, as the chart's PodMonitor scrapes them: the
        # dashboard's variables list the pipelines the stages report.
        urls = [url for url, _ in served.workers.values()]
        prom.set_targets(
            [
                {
                    "targets": [u.removeprefix("http://") for u in urls],
                    "labels": {"namespace": NAMESPACE},
                }
            ]
        )
        started = time.time()
        with openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0) as c:
            for _ in range(QUEUED):
                made = c.videos.create(
                    prompt="a lighthouse", extra_body={"num_frames": 9, "fps": 8}
                )
                assert made.status == "queued"
        queued = f'omnipipe_router_video_jobs{{namespace="{NAMESPACE}",status="queued"}}'
        deadline = time.monotonic() + 60
        while not [r for r in prom.query(queued) if float(r["value"][1]) == QUEUED]:
            assert time.monotonic() < deadline, f"{queued} never reached {QUEUED}"
            time.sleep(0.5)
        time.sleep(3 * SCRAPE)
        ended = time.time()

        overview = dashboard_png.query_dashboard(
            json.loads((DASHBOARDS / "pipeline-overview.json").read_text()),
            prom.query_range,
            {"namespace": [NAMESPACE]},
            started,
            ended,
            SCRAPE,
        )
        panels = [p for p in overview if p.title in VIDEO_PANELS]
        assert sorted(p.title for p in panels) == sorted(VIDEO_PANELS)
        assert dashboard_png.empty_targets(panels) == []
        [jobs] = [p for p in panels if p.title == "Video jobs, queued and running"]
        last = {s.name: s.points[-1][1] for t in jobs.targets for s in t.series}
        assert last["panel-video queued"] == QUEUED, last
        [age] = [p for p in panels if p.title == "Oldest video job's age"]
        oldest = {s.name: s.points[-1][1] for t in age.targets for s in t.series}
        assert 0 < oldest["panel-video queued"] < time.time() - started + 5, oldest
    finally:
        stop_cleanly(served)
        redis_proc.terminate()
        redis_proc.wait(10)
