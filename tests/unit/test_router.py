from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from omnipipe.api import parse_resource, resolve
from omnipipe.api.loading import load_pipeline
from omnipipe.router.api.images import parse_size
from omnipipe.router.app import build_app
from omnipipe.router.errors import BadRequest
from omnipipe.router.routing import ReplicaLoad, choose
from omnipipe.router.settings import RouterSettings

REPO = Path(__file__).resolve().parents[2]


def r(url: str, load: int, ready: bool = True) -> ReplicaLoad:
    return ReplicaLoad(url, ready, load, f"tcp://{url}:1")


def test_choose_least_loaded_ready_replica() -> None:
    replicas = [r("a", 3), r("b", 1), r("c", 0, ready=False)]
    assert choose(replicas, rotation=0, max_load=10) == replicas[1]


def test_ties_rotate() -> None:
    replicas = [r("a", 1), r("b", 1), r("c", 2)]
    assert [choose(replicas, i, 10).url for i in range(4)] == ["a", "b", "a", "b"]  # type: ignore[union-attr]


def test_none_when_unready_or_full() -> None:
    assert choose([r("a", 0, ready=False)], 0, 10) is None
    assert choose([r("a", 5), r("b", 7)], 0, max_load=5) is None
    assert choose([ReplicaLoad("a", True, 0, None)], 0, 5) is None  # address unknown yet


@pytest.mark.parametrize(
    "size", ["64", "64x", "0x64", "65x64", "4096x64", "64x64x3", "\uff16\uff14x64"]
)
def test_bad_sizes(size: str) -> None:
    with pytest.raises(BadRequest):
        parse_size(size)


def test_good_size() -> None:
    assert parse_size("1024x768") == (1024, 768)


def test_load_pipeline_reads_manifest_or_resolved_config(tmp_path: Path) -> None:
    from_manifest = load_pipeline(REPO / "examples/tiny-text-to-image.yaml")
    resolved = tmp_path / "pipeline.yaml"
    resolved.write_text(json.dumps(from_manifest.model_dump(mode="json")))
    assert load_pipeline(resolved) == from_manifest


def test_no_ready_replica_is_503_and_models_still_listed(tmp_path: Path) -> None:
    pipeline = resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "p"},
                "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image"},
            }
        )
    )
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({"encode": [], "denoise": [], "decode": []}))
    app = build_app(
        pipeline,
        RouterSettings(replicas_file=str(replicas), api_key=None, wake_wait_seconds=1.0),
    )
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 503
        assert client.get("/v1/models").json()["data"][0]["id"] == "p"
        started = time.monotonic()
        resp = client.post(
            "/v1/images/generations", json={"model": "p", "prompt": "x", "size": "64x64"}
        )
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "5"
        assert resp.json()["error"]["type"] == "service_unavailable"
        assert "no ready replica (waited 1s)" in resp.json()["error"]["message"]
        # It held the request for the wake-up window before giving up.
        assert time.monotonic() - started >= 1.0
        pending = 'omnipipe_router_pending_requests{pipeline="p",stage="encode"} 0.0'
        assert pending in client.get("/metrics").text


def test_the_router_is_ready_while_a_stage_that_wakes_on_demand_is_at_zero(
    tmp_path: Path,
) -> None:
    # Its Service must send the router the request that wakes the stage: a router that
    # failed /ready here kept a stage scaled to zero asleep for good (seen on a real node).
    def app_for(decode_min: int, wake_wait: float) -> Any:
        asleep = {"minReplicas": 0, "maxReplicas": 2}
        stages = [
            {"name": "encode", "autoscaling": asleep},
            {"name": "denoise", "autoscaling": asleep},
            {"name": "decode", "autoscaling": {"minReplicas": decode_min, "maxReplicas": 2}},
        ]
        pipeline = resolve(
            parse_resource(
                {
                    "apiVersion": "omnipipe.io/v1alpha1",
                    "kind": "OmniPipeline",
                    "metadata": {"name": "p"},
                    "spec": {
                        "model": "tiny://qwen-image",
                        "pipeline": "qwen-image",
                        "stages": stages,
                    },
                }
            )
        )
        replicas = tmp_path / "replicas.json"
        replicas.write_text(json.dumps({"encode": [], "denoise": [], "decode": []}))
        settings = RouterSettings(
            replicas_file=str(replicas), api_key=None, wake_wait_seconds=wake_wait
        )
        return build_app(pipeline, settings)

    with TestClient(app_for(0, 30.0)) as client:
        ready = client.get("/ready")
        assert ready.status_code == 200, ready.json()
        assert ready.json()["stages"] == {"encode": False, "denoise": False, "decode": False}
        # What serve waits on before it says ready: every replica it started, routed to.
        assert ready.json()["replicas"] == {"encode": 0, "denoise": 0, "decode": 0}
    # A stage with no replica that never sleeps, or a router that would not hold the
    # request: not ready.
    for decode_min, wake_wait in ((1, 30.0), (0, 0.0)):
        with TestClient(app_for(decode_min, wake_wait)) as client:
            assert client.get("/ready").status_code == 503
