"""weights.source cache against the real API server, controllers and kwok: the claim,
the fetch Job, ModelCached and its Events, retries, giving up, a model change, pods
mounting the claim read-only, and clean-up with the pipeline.

kwok plays the fetch's pods (tests/harness/kwok_stages.py): any Job pod completes at
once, except those of the pipeline MANUAL_PIPELINE, whose attempts a test ends one by one
with the termination message `omnipipe fetch --termination-log` writes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.harness.cluster import Cluster
from tests.harness.gitops import argo_health, kstatus
from tests.harness.kwok_stages import MANUAL_PIPELINE, MESSAGE, OUTCOME
from tests.integration.conftest import REPO, Operator, get_json, operator_can, wait_for

pytestmark = pytest.mark.integration
CACHED_EXAMPLE = REPO / "examples/kubernetes/qwen-image-cached.yaml"
NO_SPACE = "omnipipe fetch: no space left for Qwen/Qwen-Image in /weights\nreason: NoSpace\n"


def pipeline(name: str, storage_class: str, model: str = "Qwen/Qwen-Image") -> dict[str, Any]:
    return {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {
            "model": model,
            "pipeline": "qwen-image",
            "weights": {"source": "cache", "size": "1Gi", "storageClassName": storage_class},
        },
    }


def apply(cluster: Cluster, namespace: str, manifest: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))


def volumes(
    cluster: Cluster, prefix: str, count: int, storage_class: str | None = None, size: str = "2Gi"
) -> None:
    """Pre-made volumes of a class no provisioner serves: the claims bind to them (there
    is no storage driver here; kwok's pods never touch the files). Class "": the volume
    of a claim that names no class in a cluster with no default one."""
    for i in range(count):
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{prefix}-{i}"},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": prefix if storage_class is None else storage_class,
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": f"/tmp/{storage_class}-{i}"},
            },
        }
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pv))


def condition(cluster: Cluster, namespace: str, name: str, type_: str) -> dict[str, Any]:
    body = get_json(cluster, "omnip", name, "-n", namespace)
    found = [c for c in (body.get("status") or {}).get("conditions", []) if c["type"] == type_]
    return found[0] if found else {}


def of_kind(cluster: Cluster, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
    items = get_json(cluster, kind, "-n", namespace, "-l", f"omnipipe.io/pipeline={name}")
    return list(items["items"])


def stage_deployments(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    return [
        d
        for d in of_kind(cluster, namespace, "deployments", name)
        if "omnipipe.io/stage" in d["metadata"]["labels"]
    ]


def events(cluster: Cluster, namespace: str) -> list[tuple[str, str, str]]:
    items = get_json(cluster, "events", "-n", namespace)["items"]
    return [(e["type"], e["reason"], e["message"]) for e in items]


def running_fetch_pod(cluster: Cluster, namespace: str, job: str, exclude: set[str]) -> str:
    def find() -> str | None:
        pods = get_json(cluster, "pods", "-n", namespace, "-l", f"job-name={job}")["items"]
        for p in pods:
            if p["metadata"]["name"] not in exclude and p["status"].get("phase") == "Running":
                return str(p["metadata"]["name"])
        return None

    return str(wait_for(f"a running attempt of {job}", find, timeout=60))


def end_attempt(
    cluster: Cluster, namespace: str, pod: str, outcome: str, message: str = ""
) -> None:
    cluster.kubectl(
        "annotate",
        "-n",
        namespace,
        f"pod/{pod}",
        f"{MESSAGE}={message}",
        f"{OUTCOME}={outcome}",
    )


def ready(cluster: Cluster, namespace: str, name: str) -> None:
    wait_for(
        f"{name} Ready",
        lambda: condition(cluster, namespace, name, "Ready").get("status") == "True",
        timeout=90,
    )


def test_a_failed_fetch_is_retried_stages_wait_and_a_new_model_fills_a_new_claim(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    name = MANUAL_PIPELINE
    volumes(cluster, namespace, 2)
    apply(cluster, namespace, pipeline(name, namespace))
    [job] = wait_for("the fetch Job", lambda: of_kind(cluster, namespace, "jobs", name))
    job_name = job["metadata"]["name"]
    first = running_fetch_pod(cluster, namespace, job_name, set())
    # No stage pod starts before its weights are cached.
    assert stage_deployments(cluster, namespace, name) == []
    wait_for(
        "ModelCached Fetching",
        lambda: condition(cluster, namespace, name, "ModelCached").get("reason") == "Fetching",
    )

    end_attempt(cluster, namespace, first, "fail", NO_SPACE)
    failed = wait_for(
        "ModelCached to say NoSpace",
        lambda: (
            (c := condition(cluster, namespace, name, "ModelCached")).get("reason") == "NoSpace"
            and c
        ),
    )
    assert failed["status"] == "False"
    assert "attempt 1 of 2 failed: no space left for Qwen/Qwen-Image" in failed["message"]
    assert "retrying with back-off" in failed["message"]
    assert condition(cluster, namespace, name, "Ready")["reason"] == "ModelNotCached"
    # A retry may yet succeed: Flux and Argo CD wait (InProgress, Progressing), not fail.
    assert condition(cluster, namespace, name, "Stalled")["status"] == "False"
    assert condition(cluster, namespace, name, "Reconciling")["reason"] == "FetchingWeights"
    live = get_json(cluster, "omnip", name, "-n", namespace)
    assert (kstatus(live)[0], argo_health(live)[0]) == ("InProgress", "Progressing")
    assert any(
        t == "Warning" and r == "FetchFailed" and m.startswith("NoSpace: ")
        for t, r, m in events(cluster, namespace)
    )
    assert stage_deployments(cluster, namespace, name) == []

    # The Job controller's retry (after its back-off) succeeds: the stages start.
    second = running_fetch_pod(cluster, namespace, job_name, {first})
    end_attempt(cluster, namespace, second, "succeed")
    ready(cluster, namespace, name)
    assert len(stage_deployments(cluster, namespace, name)) == 3
    serving = get_json(cluster, "omnip", name, "-n", namespace)["status"]["currentRevision"]

    # A new model: a new claim and Job beside the old; the old revision serves meanwhile.
    apply(cluster, namespace, pipeline(name, namespace, model="Qwen/Qwen-Image-2512"))
    new_job = wait_for(
        "a second fetch Job",
        lambda: [
            j["metadata"]["name"]
            for j in of_kind(cluster, namespace, "jobs", name)
            if j["metadata"]["name"] != job_name
        ],
    )[0]
    attempt = running_fetch_pod(cluster, namespace, new_job, set())
    status = get_json(cluster, "omnip", name, "-n", namespace)["status"]
    assert status["currentRevision"] == serving
    assert {
        d["metadata"]["labels"]["omnipipe.io/revision"]
        for d in stage_deployments(cluster, namespace, name)
    } == {serving}
    end_attempt(cluster, namespace, attempt, "succeed")
    wait_for(
        "the new revision to serve",
        lambda: (
            (s := get_json(cluster, "omnip", name, "-n", namespace)["status"])["currentRevision"]
            != serving
            and s["currentRevision"] == s["updateRevision"]
        ),
        timeout=90,
    )
    ready(cluster, namespace, name)
    # The old model's claim is no longer wanted: gone once no pod mounts it.
    wait_for(
        "only the new claim left",
        lambda: len(of_kind(cluster, namespace, "pvc", name)) == 1,
        timeout=60,
    )


def test_a_fetch_that_keeps_failing_gives_up_with_its_reason(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    name = MANUAL_PIPELINE
    volumes(cluster, namespace, 1)
    apply(cluster, namespace, pipeline(name, namespace))
    [job] = wait_for("the fetch Job", lambda: of_kind(cluster, namespace, "jobs", name))
    job_name = job["metadata"]["name"]
    tried: set[str] = set()
    for _ in range(2):  # backoffLimit 1 (conftest): two attempts
        pod = running_fetch_pod(cluster, namespace, job_name, tried)
        tried.add(pod)
        end_attempt(cluster, namespace, pod, "fail", NO_SPACE)
    gave_up = wait_for(
        "ModelCached to give up",
        lambda: (
            "giving up"
            in (c := condition(cluster, namespace, name, "ModelCached")).get("message", "")
            and c
        ),
        timeout=60,
    )
    assert (gave_up["status"], gave_up["reason"]) == ("False", "NoSpace")
    assert f"kubectl delete job {job_name}" in gave_up["message"]
    # No retry is left: Stalled, which Flux reads as Failed and Argo CD as Degraded.
    stalled = condition(cluster, namespace, name, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "FetchFailed")
    assert "gave up after 2 attempts: NoSpace" in stalled["message"]
    live = get_json(cluster, "omnip", name, "-n", namespace)
    assert kstatus(live) == ("Failed", stalled["message"])
    assert argo_health(live)[0] == "Degraded"
    assert stage_deployments(cluster, namespace, name) == []
    assert (
        json.loads(cluster.kubectl("get", "job", job_name, "-n", namespace, "-o", "json").stdout)[
            "status"
        ]["failed"]
        == 2
    )


def test_a_model_the_source_refuses_stalls_at_its_first_attempt(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    name = MANUAL_PIPELINE
    volumes(cluster, namespace, 1)
    apply(cluster, namespace, pipeline(name, namespace))
    [job] = wait_for("the fetch Job", lambda: of_kind(cluster, namespace, "jobs", name))
    pod = running_fetch_pod(cluster, namespace, job["metadata"]["name"], set())
    refused = "omnipipe fetch: Qwen/Qwen-Image: no such model\nreason: UnknownModel\n"
    end_attempt(cluster, namespace, pod, "fail", refused)
    stalled = wait_for(
        "Stalled ModelRefused",
        lambda: (c := condition(cluster, namespace, name, "Stalled")).get("status") == "True" and c,
    )
    assert stalled["reason"] == "ModelRefused"
    assert "UnknownModel: Qwen/Qwen-Image: no such model" in stalled["message"]
    live = get_json(cluster, "omnip", name, "-n", namespace)
    assert kstatus(live)[0] == "Failed"
    assert argo_health(live) == ("Degraded", f"ModelRefused: {stalled['message']}")
    # The stall is an Event too, once (`kubectl get events`, `kubectl describe omnip`).
    warned = wait_for(
        "the Stalled event",
        lambda: [e for e in events(cluster, namespace) if e[1] == "Stalled"],
    )
    assert warned == [("Warning", "Stalled", f"ModelRefused: {stalled['message']}")]


def test_the_operator_may_fill_caches_but_only_list_and_watch_pods(cluster: Cluster) -> None:
    def can(*args: str) -> bool:
        return operator_can(cluster, *args)

    for verb in ("create", "patch", "delete", "list"):
        assert can(verb, "persistentvolumeclaims", "-A"), verb
        assert can(verb, "jobs.batch", "-A"), verb
    assert can("watch", "jobs.batch", "-A")
    assert can("list", "pods", "-A")
    assert can("watch", "pods", "-A")  # a pod's waits move Stalled
    for verb in ("get", "create", "patch", "delete"):
        assert not can(verb, "pods", "-A"), verb
    assert not can("get", "pods/log", "-A")
    assert not can("create", "pods/exec", "-A")
    assert not can("create", "persistentvolumes")


def test_a_users_claim_and_an_image_are_mounted_read_only_and_the_claim_outlives_the_pipeline(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """source claim and source image: no fetch Job, every stage pod mounts the weights
    read-only, and deleting the pipeline leaves the user's claim alone. (The API server
    runs with the ImageVolume feature gate: without it, it drops image volumes.)"""
    volumes(cluster, namespace, 1, storage_class="", size="100Gi")
    mine = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "my-weights"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "",
            "resources": {"requests": {"storage": "100Gi"}},
        },
    }
    apply(cluster, namespace, mine)
    sources = {
        "from-claim": {"source": "claim", "claimName": "my-weights", "path": "qwen-image"},
        "from-image": {"source": "image", "image": "registry.example/qwen-image-weights:1"},
    }
    for name, weights in sources.items():
        manifest = pipeline(name, "")
        manifest["spec"]["weights"] = weights
        apply(cluster, namespace, manifest)
    for name in sources:
        ready(cluster, namespace, name)
        assert not of_kind(cluster, namespace, "jobs", name)
        assert condition(cluster, namespace, name, "ModelCached") == {}
    expected = {
        "from-claim": (
            {"persistentVolumeClaim": {"claimName": "my-weights", "readOnly": True}},
            "/var/lib/omnipipe/weights/qwen-image",
        ),
        "from-image": (
            {
                "image": {
                    "reference": "registry.example/qwen-image-weights:1",
                    "pullPolicy": "IfNotPresent",
                }
            },
            "/var/lib/omnipipe/weights",
        ),
    }
    for name, (source, path) in expected.items():
        pods = get_json(
            cluster, "pods", "-n", namespace, "-l", f"omnipipe.io/pipeline={name},omnipipe.io/stage"
        )["items"]
        assert len(pods) == 3, name
        for pod in pods:
            [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "weights"]
            assert volume == {"name": "weights", **source}
            [container] = pod["spec"]["containers"]
            [mount] = [m for m in container["volumeMounts"] if m["name"] == "weights"]
            assert mount["readOnly"] is True
            assert {"name": "OMNIPIPE_WORKER_MODEL_PATH", "value": path} in container["env"]
    cluster.kubectl("delete", "omnip", "from-claim", "-n", namespace, "--wait=false")
    wait_for(
        "from-claim's stage Deployments to go",
        lambda: not stage_deployments(cluster, namespace, "from-claim"),
        timeout=90,
    )
    claims = get_json(cluster, "pvc", "-n", namespace)["items"]
    assert [c["metadata"]["name"] for c in claims] == ["my-weights"]


# Last in the file: the garbage collector watches a new CRD's objects only after its
# next resync (about 30 s after the session installed it), and this test waits on it.
def test_the_cached_example_goes_from_kubectl_apply_to_ready_and_away_with_the_pipeline(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    """The README's walk-through: examples/kubernetes/qwen-image-cached.yaml as it is."""
    volumes(cluster, namespace, 1, storage_class="", size="100Gi")
    cluster.kubectl("apply", "-n", namespace, "-f", str(CACHED_EXAMPLE))
    cluster.kubectl(
        "wait",
        "-n",
        namespace,
        "omnip/qwen-image",
        "--for=condition=Ready",
        "--timeout=90s",
        timeout=100,
    )
    [claim] = of_kind(cluster, namespace, "pvc", "qwen-image")
    [job] = of_kind(cluster, namespace, "jobs", "qwen-image")
    assert claim["status"]["phase"] == "Bound"
    assert job["status"]["succeeded"] == 1
    owner = get_json(cluster, "omnip", "qwen-image", "-n", namespace)["metadata"]["uid"]
    assert [r["uid"] for r in claim["metadata"]["ownerReferences"]] == [owner]
    cached = condition(cluster, namespace, "qwen-image", "ModelCached")
    assert (cached["status"], cached["reason"], cached["message"]) == (
        "True",
        "Cached",
        "1/1 models cached",
    )
    seen = events(cluster, namespace)
    assert any(
        r == "Created" and f"PersistentVolumeClaim/{claim['metadata']['name']}" in m
        for _, r, m in seen
    )
    assert any(r == "Created" and f"Job/{job['metadata']['name']}" in m for _, r, m in seen)
    assert ("Normal", "ModelCached", "1/1 models cached") in seen
    # Every stage pod mounts the claim read-only and is told where the model is.
    pods = get_json(
        cluster, "pods", "-n", namespace, "-l", "omnipipe.io/pipeline=qwen-image,omnipipe.io/stage"
    )["items"]
    assert len(pods) == 3
    for pod in pods:
        [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "weights"]
        assert volume["persistentVolumeClaim"] == {
            "claimName": claim["metadata"]["name"],
            "readOnly": True,
        }
        [container] = pod["spec"]["containers"]
        [mount] = [m for m in container["volumeMounts"] if m["name"] == "weights"]
        assert mount["readOnly"] is True
        assert {
            "name": "OMNIPIPE_WORKER_MODEL_PATH",
            "value": "/var/lib/omnipipe/weights/model",
        } in container["env"]
    # Deleting the pipeline takes the operator-made claim and Job with it.
    cluster.kubectl("delete", "omnip", "qwen-image", "-n", namespace, "--wait=false")
    wait_for(
        "the claim and the Job to go",
        lambda: not of_kind(cluster, namespace, "pvc,jobs", "qwen-image"),
        timeout=90,
    )
