"""spec.weights: the claim and fetch Job the operator builds, what stage pods mount, and
the ModelCached condition read from observed Jobs and pods."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omnipipe.api import parse_resource
from omnipipe.api.status import ConditionStatus
from omnipipe.api.yamlio import dump_all
from omnipipe.cli import main
from omnipipe.operator.builders import build_children, build_context, fetch_job_for
from omnipipe.operator.settings import OperatorSettings
from omnipipe.operator.weights_status import ObservedFetch, model_cached

GOLDEN = Path(__file__).parent / "golden"
SETTINGS = OperatorSettings(
    worker_image="omnipipe/worker:test", router_image="omnipipe/router:test"
)
CACHE = {
    "source": "cache",
    "size": "20Gi",
    "storageClassName": "fast",
    "accessModes": ["ReadWriteOnce", "ReadOnlyMany"],
    "hubTokenSecretRef": {"name": "hub", "key": "token"},
}


def resource(weights: dict[str, Any], model: str = "Qwen/Qwen-Image") -> Any:
    return parse_resource(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": "p", "namespace": "ns", "uid": "uid-1", "generation": 1},
            "spec": {"model": model, "pipeline": "qwen-image", "weights": weights},
        }
    )


def kinds(children: list[dict[str, Any]]) -> list[str]:
    return [m["kind"] for m in children]


def pod_spec(children: list[dict[str, Any]], stage: str) -> dict[str, Any]:
    for m in children:
        if m["kind"] == "Deployment" and m["metadata"]["labels"].get("omnipipe.io/stage") == stage:
            return dict(m["spec"]["template"]["spec"])
    raise AssertionError(f"no Deployment of stage {stage}")


def test_cache_golden_claim_and_job_first_then_stages_once_fetched(
    request: pytest.FixtureRequest,
) -> None:
    res = resource(CACHE)
    waiting = build_children(build_context(res, SETTINGS))
    # Nothing that runs the model exists before its claim is filled.
    assert "Deployment" in kinds(waiting)  # the router only
    assert not any(
        m["kind"] == "Deployment" and "omnipipe.io/stage" in m["metadata"]["labels"]
        for m in waiting
    )
    job = fetch_job_for(build_context(res, SETTINGS), "Qwen/Qwen-Image")
    fetched = build_children(build_context(res, SETTINGS, fetched=frozenset({job})))
    rendered = dump_all(fetched)
    golden = GOLDEN / "weights-cache.yaml"
    if request.config.getoption("--update-golden"):
        golden.write_text(rendered)
    assert rendered == golden.read_text(), "builders changed weights-cache.yaml: --update-golden"
    claim, fetch = (m for m in fetched if m["kind"] in ("PersistentVolumeClaim", "Job"))
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce", "ReadOnlyMany"]
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    container = fetch["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:3] == ["fetch", "Qwen/Qwen-Image", "/weights/model"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # The token travels by reference only.
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}} in (
        container["env"]
    )
    assert len(fetch["metadata"]["name"]) <= 63
    spec = pod_spec(fetched, "denoise")
    [mount] = [v for v in spec["containers"][0]["volumeMounts"] if v["name"] == "weights"]
    assert mount["readOnly"] is True
    [volume] = [v for v in spec["volumes"] if v["name"] == "weights"]
    assert volume["persistentVolumeClaim"] == {
        "claimName": claim["metadata"]["name"],
        "readOnly": True,
    }
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["OMNIPIPE_WORKER_MODEL_PATH"] == "/var/lib/omnipipe/weights/model"


def test_a_new_model_or_hub_revision_is_a_new_claim_beside_the_old() -> None:
    def claim(weights: dict[str, Any], model: str = "Qwen/Qwen-Image") -> str:
        children = build_children(build_context(resource(weights, model), SETTINGS))
        [c] = [m for m in children if m["kind"] == "PersistentVolumeClaim"]
        return str(c["metadata"]["name"])

    first = claim(CACHE)
    assert claim(CACHE) == first
    assert claim({**CACHE, "revision": "v2"}) != first
    assert claim({**CACHE, "size": "40Gi"}) != first
    assert claim(CACHE, "Qwen/Qwen-Image-2512") != first


def test_claim_and_image_mount_read_only_and_download_stays_the_default() -> None:
    claimed = build_children(
        build_context(
            resource({"source": "claim", "claimName": "models", "path": "qwen"}), SETTINGS
        )
    )
    spec = pod_spec(claimed, "encode")
    assert {
        "name": "weights",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in (spec["volumes"])
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["OMNIPIPE_WORKER_MODEL_PATH"] == "/var/lib/omnipipe/weights/qwen"
    assert "PersistentVolumeClaim" not in kinds(claimed)

    image = build_children(
        build_context(resource({"source": "image", "image": "registry/qwen:1"}), SETTINGS)
    )
    spec = pod_spec(image, "decode")
    assert {
        "name": "weights",
        "image": {"reference": "registry/qwen:1", "pullPolicy": "IfNotPresent"},
    } in spec["volumes"]
    [mount] = [v for v in spec["containers"][0]["volumeMounts"] if v["name"] == "weights"]
    assert mount == {"name": "weights", "mountPath": "/var/lib/omnipipe/weights", "readOnly": True}

    default = build_children(build_context(resource({}), SETTINGS))
    spec = pod_spec(default, "decode")
    assert not [v for v in spec["volumes"] if v["name"] == "weights"]
    assert "OMNIPIPE_WORKER_MODEL_PATH" not in {e["name"] for e in spec["containers"][0]["env"]}
    assert not {"Job", "PersistentVolumeClaim"} & set(kinds(default))


def job(name: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": {"omnipipe.io/model": "m"}},
        "status": status,
    }


def failed_pod(message: str, finished: str) -> dict[str, Any]:
    return {
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "state": {
                        "terminated": {"exitCode": 3, "finishedAt": finished, "message": message}
                    }
                }
            ],
        }
    }


NO_SPACE = "omnipipe fetch: no space left for m in /weights\nreason: NoSpace\n"


def test_model_cached_reports_progress_retries_and_the_fetch_reason() -> None:
    expected = [("m", "p-fetch-1"), ("n", "p-fetch-2")]

    def cond(*fetches: ObservedFetch) -> tuple[ConditionStatus, str, str]:
        return model_cached(expected, {f.job: f for f in fetches}, backoff_limit=2)

    status, reason, message = cond()
    assert (status, reason) == (ConditionStatus.FALSE, "Fetching")
    assert message.startswith("0/2 models cached")

    done = ObservedFetch.from_manifests(job("p-fetch-1", succeeded=1), [])
    stuck = ObservedFetch.from_manifests(
        job("p-fetch-2", active=1),
        [
            {
                "status": {
                    "phase": "Pending",
                    "conditions": [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "message": "0/3 nodes are available: pod has unbound immediate "
                            "PersistentVolumeClaims.",
                        }
                    ],
                }
            }
        ],
    )
    status, reason, message = cond(done, stuck)
    assert (status, reason) == (ConditionStatus.FALSE, "FetchPending")
    assert message.endswith("pod has unbound immediate PersistentVolumeClaims.")
    retrying = ObservedFetch.from_manifests(
        job("p-fetch-2", failed=1, active=1),
        [
            failed_pod("reason: Unreachable", "2026-01-01T00:00:00Z"),
            failed_pod(NO_SPACE, "2026-01-01T00:01:00Z"),
        ],
    )
    status, reason, message = cond(done, retrying)
    assert (status, reason) == (ConditionStatus.FALSE, "NoSpace")  # the latest attempt's
    assert "1/2 models cached" in message
    assert "attempt 1 of 3 failed: no space left for m in /weights; retrying" in message

    gave_up = ObservedFetch.from_manifests(
        job("p-fetch-2", failed=3, conditions=[{"type": "Failed", "status": "True"}]),
        [failed_pod("Traceback ...\nKeyError: 'x'", "2026-01-01T00:02:00Z")],
    )
    status, reason, message = cond(done, gave_up)
    assert (status, reason) == (ConditionStatus.FALSE, "FetchFailed")
    assert "giving up" in message
    assert "kubectl delete job p-fetch-2" in message

    # Its pods gone: the Job's own Failed condition still says why it stopped.
    podless = ObservedFetch.from_manifests(
        job(
            "p-fetch-2",
            failed=3,
            conditions=[
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit",
                }
            ],
        ),
        [],
    )
    status, reason, message = cond(done, podless)
    assert (status, reason) == (ConditionStatus.FALSE, "BackoffLimitExceeded")
    assert "giving up: Job has reached the specified backoff limit" in message

    both = ObservedFetch.from_manifests(job("p-fetch-2", succeeded=1, failed=2), [])
    assert cond(done, both) == (ConditionStatus.TRUE, "Cached", "2/2 models cached")


def test_fetch_writes_its_reason_as_the_termination_message(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    assert (
        main(["fetch", "tiny://nothing", str(tmp_path / "m"), "--termination-log", str(log)]) == 3
    )
    text = log.read_text()
    assert text.rstrip().endswith("reason: UnknownModel")
    assert "unknown tiny model" in text


def test_local_mode_builds_tiny_models_through_fetch(tmp_path: Path) -> None:
    from omnipipe.checkpoints.fetch import COMPLETE
    from omnipipe.checkpoints.tiny import resolve_model_path

    path = Path(resolve_model_path("tiny://qwen-image", tmp_path))
    assert json.loads((path / COMPLETE).read_text()) == {
        "model": "tiny://qwen-image",
        "revision": None,
    }
    assert not list(tmp_path.glob(".*.partial"))
    assert resolve_model_path("tiny://qwen-image", tmp_path) == str(path)  # built once
