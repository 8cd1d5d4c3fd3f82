"""Every panel of the chart's dashboards shows live data, and one of the chart's alerts
fires live. conftest's Prometheus (the chart's PodMonitor as scrape jobs, the chart's
alerts with 5 s holds) scrapes a tiny omni and a tiny text-to-image pipeline while the
openai client sends what users send (streamed chat with audio, speech, images) and what
goes wrong (4xx, 5xx); the autoscaler takes a stage to zero and wakes it, a namespace's
quota fails a reconcile, and a stage is stopped. Then every target of every panel runs
over the test's own time range, the template variables filled in as Grafana fills them,
and must return a series with a point; hack/dashboard-png.py draws the overview.

Named to run last in the tier: it cordons the node for a minute."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import wave
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import yaml
from PIL import Image

from tests.harness.cluster import REPO
from tests.harness.live_panels import DASHBOARDS, VIDEO_PANELS, dashboard_png
from tests.harness.node import NODE_NAME, RealNode
from tests.harness.prometheus import Prometheus
from tests.realnode.conftest import (
    EXPECTED_OPERATOR_ERRORS,
    MUST_SPEAK,
    SPEAKING_SEED,
    apply_and_wait_ready,
    diagnose,
    pods,
    router_url,
    wait_for,
)

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(900)]

OMNI, IMAGE = "tiny-omni", "tiny-image"
STOPPED = "talker"  # an omni stage that speech needs
ALERT = "OmnipipeStageNoReadyReplica"
# The ResourceQuota that refuses the operator a Secret: every error line it causes names it.
QUOTA = "telemetry-test-no-secrets"
# The Grafana data source's scrape interval, Grafana's default: the step is never finer
# and $__rate_interval is 4 of it.
SCRAPE = 15.0


def image_manifest() -> str:
    """tiny-image with denoise scaled to zero when idle and woken by a request: the
    scaling decisions (ScaleDown, WakeOnDemand) the operator dashboard shows."""
    return yaml.safe_dump(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": IMAGE},
            "spec": {
                "model": "tiny://qwen-image",
                "pipeline": "qwen-image",
                "stages": [
                    {
                        "name": "denoise",
                        "autoscaling": {
                            "minReplicas": 0,
                            "maxReplicas": 1,
                            "metric": "inflight",
                            "target": 1,
                            # Up through the traffic that follows Ready (a stage
                            # woken under the other pipeline's start-up took over the
                            # router's 60 s wake wait), at zero soon after.
                            "scaleDownStabilizationSeconds": 40,
                        },
                    }
                ],
            },
        }
    )


def quota_blocked_pipeline(node: RealNode, namespace: str) -> str:
    """A pipeline in a namespace whose ResourceQuota allows no Secret: the operator's first
    write, the pipeline's credential Secret, is refused, so its reconcile fails (the
    operator dashboard's errors panel) before any pod exists. Returns the namespace."""
    blocked = f"{namespace}-quota"
    node.kubectl("create", "namespace", blocked)
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": QUOTA},
        "spec": {"hard": {"secrets": "0"}},
    }
    node.kubectl("apply", "-n", blocked, "-f", "-", input=yaml.safe_dump(quota))
    EXPECTED_OPERATOR_ERRORS.append(QUOTA)
    pipeline = {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "blocked"},
        "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image"},
    }
    node.kubectl("apply", "-n", blocked, "-f", "-", input=yaml.safe_dump(pipeline))
    return blocked


def client(url: str, timeout: float = 300) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=timeout)


def answers(c: openai.OpenAI) -> bool:
    try:
        return any(m.id for m in c.models.list())
    except openai.APIConnectionError:
        return False


def refused(call: Callable[[], Any]) -> int:
    """The status of a request that must fail with a 4xx or 5xx."""
    with pytest.raises(openai.APIStatusError) as failed:
        call()
    return failed.value.status_code


def bad_requests(c: openai.OpenAI, model: str) -> None:
    """A 400 and a 404, twice, 2 s apart: the second makes the counters' rates non-zero."""
    for _ in range(2):
        codes = [
            refused(lambda: c.images.generate(model=model, prompt="x", size="huge")),
            refused(
                lambda: c.chat.completions.create(
                    model="no-such-model", messages=[{"role": "user", "content": "hi"}]
                )
            ),
        ]
        assert all(400 <= code < 500 for code in codes), codes
        time.sleep(2)


def draw_images(url: str) -> None:
    with client(url) as c:
        wait_for("the image router's Service", lambda: answers(c), 30)
        images(c, ("64x64", "128x128", "64x64"))
        bad_requests(c, IMAGE)


def images(c: openai.OpenAI, sizes: tuple[str, ...]) -> None:
    """One image a size, 1.5 s apart: a stage pod's transfer series appear with its first
    hand-off, so only later ones, in later scrapes, give them a rate."""
    for size in sizes:
        r = c.images.generate(
            model=IMAGE, prompt="a lighthouse", size=size, extra_body={"num_inference_steps": 2}
        )
        assert r.data[0].b64_json
        time.sleep(1.5)


def talk(url: str) -> None:
    """Streamed chat with text and audio, twice, and speech: every omni stage works."""
    with client(url) as c:
        wait_for("the omni router's Service", lambda: answers(c), 30)
        for _ in range(2):
            kinds, pcm = set(), b""
            stream = c.chat.completions.create(
                model=OMNI,
                messages=[{"role": "user", "content": "hello"}],
                modalities=["text", "audio"],
                audio={"voice": "Ethan", "format": "pcm16"},
                stream=True,
                seed=SPEAKING_SEED,
            )
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        kinds.add("text")
                    audio = getattr(choice.delta, "audio", None)
                    if audio is not None and audio.data:
                        kinds.add("audio")
                        pcm += base64.b64decode(audio.data)
            assert kinds == {"text", "audio"}, kinds
            assert np.frombuffer(pcm, "<i2").any(), "no audio, or silent audio"
        speech = c.audio.speech.create(
            model=OMNI, input="hello world", voice="Ethan", extra_body=MUST_SPEAK
        )
        with wave.open(io.BytesIO(speech.content)) as w:
            samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
        assert samples.size > 0, "speech without samples"
        assert samples.any(), "silent speech"
        bad_requests(c, OMNI)


def stage_replicas(node: RealNode, namespace: str, pipeline: str, stage: str) -> int | None:
    out = node.kubectl(
        "get",
        "deployment",
        "-n",
        namespace,
        "-l",
        f"omnipipe.io/pipeline={pipeline},omnipipe.io/stage={stage}",
        "-o",
        "jsonpath={.items[*].spec.replicas}",
        check=False,
    ).stdout.split()
    return int(out[0]) if out else None


def scale_denoise_to_zero_and_wake(node: RealNode, prom: Prometheus, namespace: str) -> float:
    """Idle, denoise goes to zero (ScaleDown); an image request wakes it (WakeOnDemand).
    The seconds the held request took."""
    selector = f"omnipipe.io/pipeline={IMAGE},omnipipe.io/stage=denoise"
    wait_for("denoise at zero", lambda: stage_replicas(node, namespace, IMAGE, "denoise") == 0, 180)
    wait_for("the denoise pod gone", lambda: not pods(node, namespace, selector), 120)
    started = time.monotonic()
    with client(router_url(node, namespace, IMAGE)) as c:
        try:
            images(c, ("64x64",))
        except openai.APIStatusError as exc:
            # 503 with Retry-After: the pod took longer than the router's wake wait
            # (60 s; under 15 s on an idle machine, not on a busy one). A client retries.
            if exc.status_code != 503:
                raise
            print(f"[realnode] telemetry: retrying after {exc}", file=sys.stderr)
            images(c, ("64x64",))
        held = time.monotonic() - started - 1.5
        images(c, ("64x64", "64x64"))  # the woken pod's series need a second scrape
    decided = (
        f'omnipipe_operator_scaling_decisions_total{{namespace="{namespace}",'
        f'pipeline="{IMAGE}",stage="denoise",reason=~"ScaleDown|WakeOnDemand"}}'
    )
    wait_for(
        "Prometheus to hold the operator's ScaleDown and WakeOnDemand decisions",
        lambda: len({s["metric"]["reason"] for s in prom.query(decided)}) == 2,
        30,
    )
    return held


@contextmanager
def cordoned(node: RealNode) -> Iterator[None]:
    """No pod can be placed: a deleted pod's replacement stays Pending. The operator is
    not fought: its Deployment still asks for the replica."""
    node.kubectl("cordon", NODE_NAME)
    try:
        yield
    finally:
        node.kubectl("uncordon", NODE_NAME, check=False)


def active_alerts(prom: Prometheus, namespace: str) -> list[dict[str, Any]]:
    return [
        a
        for a in prom.alerts()
        if a["labels"].get("alertname") == ALERT
        and a["labels"].get("namespace") == namespace
        and a["labels"].get("pipeline") == OMNI
        and a["labels"].get("stage") == STOPPED
    ]


def router_sees_ready(router: str, stage: str) -> bool:
    """The stage's readiness as the router's /ready reports it (503 once one is not)."""
    try:
        with urllib.request.urlopen(f"{router}/ready", timeout=5) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
    return bool(body["stages"][stage])


def stop_stage(node: RealNode, prom: Prometheus, namespace: str) -> tuple[float, dict[str, Any]]:
    """Stop the omni pipeline's talker (its pod deleted on a cordoned node) and watch
    Prometheus fire the alert, while two speech requests through it fail with a 5xx
    once the router's wake wait (60 s) runs out. (seconds to firing, the alert)"""
    (router,) = pods(
        node, namespace, f"omnipipe.io/pipeline={OMNI},app.kubernetes.io/component=router"
    )
    # The router's pod, not its Service: the router reports itself unready while a stage
    # has no replica, and its Service drops it.
    url = f"http://{router['status']['podIP']}:8000"
    assert active_alerts(prom, namespace) == [], "the alert is active on a healthy pipeline"
    statuses: list[int | str] = []

    def speak(delay: float) -> None:
        time.sleep(delay)
        with client(f"{url}/v1", timeout=150) as c:
            try:
                c.audio.speech.create(model=OMNI, input="hello", voice="Ethan")
                statuses.append(200)
            except openai.APIStatusError as exc:
                statuses.append(exc.status_code)
            except Exception as exc:
                statuses.append(repr(exc))

    with cordoned(node):
        stopped = time.monotonic()
        node.kubectl(
            "delete",
            "pod",
            "-n",
            namespace,
            "-l",
            f"omnipipe.io/pipeline={OMNI},omnipipe.io/stage={STOPPED}",
            "--wait=false",
        )
        wait_for(
            f"the router to see {STOPPED} unready", lambda: not router_sees_ready(url, STOPPED), 30
        )
        threads = [threading.Thread(target=speak, args=(d,), daemon=True) for d in (0, 3)]
        for t in threads:
            t.start()
        try:
            alert = wait_for(
                f"{ALERT} to fire for {OMNI}/{STOPPED}",
                lambda: next(
                    (a for a in active_alerts(prom, namespace) if a["state"] == "firing"), None
                ),
                120,
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{diagnose(node, namespace)}") from None
        fired = time.monotonic() - stopped
        for t in threads:
            t.join(timeout=150)
    assert len(statuses) == 2, statuses
    assert all(isinstance(s, int) and s >= 500 for s in statuses), statuses
    return fired, alert


def check_dashboards(
    prom: Prometheus, namespace: str, start: float, end: float
) -> tuple[int, list[str]]:
    """Every target of every panel of every dashboard (the video panels aside: no video
    pipeline runs here, see VIDEO_PANELS), with the variables filled in as
    Grafana fills them once this test's namespace is picked (the others at their default,
    All; a repeated panel once per stage). (targets run, the empty ones with their panel)"""
    ran, empty = 0, []
    for path in sorted(DASHBOARDS.glob("*.json")):
        results = dashboard_png.query_dashboard(
            json.loads(path.read_text()),
            prom.query_range,
            {"namespace": [namespace]},
            start,
            end,
            SCRAPE,
        )
        assert results, f"{path.name}: no panel with a query"
        left = [p.title for p in results if p.title in VIDEO_PANELS]
        assert left == [] or sorted(left) == sorted(VIDEO_PANELS), left
        results = [p for p in results if p.title not in VIDEO_PANELS]
        ran += sum(len(p.targets) for p in results)
        empty += [f"{path.name}: {e}" for e in dashboard_png.empty_targets(results)]
    return ran, empty


def test_every_panel_shows_live_data_and_a_stopped_stage_fires_its_alert(
    node: RealNode, operator: str, prom: Prometheus, namespace: str, tmp_path: Path
) -> None:
    started = time.time()
    blocked = quota_blocked_pipeline(node, namespace)
    try:
        # One after the other: two pipelines starting at once on 2 cores slow both.
        apply_and_wait_ready(node, namespace, REPO / "examples/tiny-omni.yaml", OMNI)
        apply_and_wait_ready(node, namespace, image_manifest(), IMAGE)
        draw_images(router_url(node, namespace, IMAGE))
        talk(router_url(node, namespace, OMNI))
        ready_and_driven = time.time() - started
        woke = scale_denoise_to_zero_and_wake(node, prom, namespace)
        fired, alert = stop_stage(node, prom, namespace)
    finally:
        node.kubectl("delete", "namespace", blocked, "--wait=false", check=False)
    print(
        f"[realnode] telemetry: pipelines ready and driven in {ready_and_driven:.0f} s, "
        f"denoise woke from zero in {woke:.1f} s, {ALERT} fired {fired:.1f} s after "
        f"{STOPPED} was stopped",
        file=sys.stderr,
    )
    assert alert["labels"]["severity"] == "critical"
    assert OMNI in alert["annotations"]["summary"], alert
    assert STOPPED in alert["annotations"]["summary"], alert

    # The range ends on a step (Grafana aligns it): wait until one is past the last 5xx
    # and the scrape after it.
    last = time.time() + 2
    time.sleep(max(0.0, (math.floor(last / SCRAPE) + 1) * SCRAPE - time.time()))
    ended = time.time()
    ran, empty = check_dashboards(prom, namespace, started, ended)
    assert empty == [], f"{len(empty)} of {ran} queries returned no data:\n" + "\n".join(empty)

    # The check can fail: a made-up metric in a panel is reported.
    overview = json.loads((DASHBOARDS / "pipeline-overview.json").read_text())
    made_up = {
        "templating": overview["templating"],
        "panels": [
            {
                "type": "timeseries",
                "title": "made up",
                "targets": [
                    {
                        "refId": "A",
                        "expr": "rate(omnipipe_no_such_metric_total"
                        '{namespace=~"$namespace"}[$__rate_interval])',
                    }
                ],
            }
        ],
    }
    results = dashboard_png.query_dashboard(
        made_up, prom.query_range, {"namespace": [namespace]}, started, ended, SCRAPE
    )
    assert dashboard_png.empty_targets(results) == [
        f'made up [A]: rate(omnipipe_no_such_metric_total{{namespace=~"{namespace}"}}[1m])'
    ]

    png = tmp_path / "pipeline-overview.png"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "hack/dashboard-png.py"),
            "--prometheus",
            prom.url,
            "--dashboard",
            str(DASHBOARDS / "pipeline-overview.json"),
            "--var",
            f"namespace={namespace}",
            "--var",
            "pipeline=All",
            "--from",
            str(started),
            "--to",
            str(ended),
            "--scrape-interval",
            str(SCRAPE),
            "--out",
            str(png),
        ],
        check=True,
        timeout=120,
    )
    with Image.open(png) as image:
        assert image.width == dashboard_png.WIDTH
    if target := os.environ.get("OMNIPIPE_DASHBOARD_PNG"):
        shutil.copyfile(png, REPO / target)
    print(
        f"[realnode] telemetry: {ran} panel queries with data over "
        f"{ended - started:.0f} s; the overview drawn to {png}",
        file=sys.stderr,
    )
