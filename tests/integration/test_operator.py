"""The operator against a real kube-apiserver, controller-manager, scheduler and kwok,
driven with kubectl as a user would."""

from __future__ import annotations

import base64
import copy
import itertools
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from omnipipe.api import parse_resource, resolve
from omnipipe.api.revision import pipeline_revision
from tests.harness.cluster import Cluster
from tests.integration.conftest import (
    REPO,
    Operator,
    children,
    get_json,
    operator_can,
    wait_for,
)
from tests.invalid_manifests import CASES, Invalid

pytestmark = pytest.mark.integration
EXAMPLE = REPO / "examples/qwen-image.yaml"


def revision(manifest: dict[str, Any]) -> str:
    return pipeline_revision(resolve(parse_resource(manifest)))


REV = revision(yaml.safe_load(EXAMPLE.read_text()))
STAGES = ("encode", "denoise", "decode")
EXPECTED = {
    ("ConfigMap", f"qwen-image-config-{REV}"),
    ("Deployment", "qwen-image-router"),
    ("Service", "qwen-image-router"),
    *((("Deployment", f"qwen-image-{name}-{REV}")) for name in STAGES),
    *((("Service", f"qwen-image-{name}")) for name in STAGES),
}


def apply(cluster: Cluster, namespace: str, manifest: dict[str, Any] | Path) -> None:
    if isinstance(manifest, Path):
        cluster.kubectl("apply", "-n", namespace, "-f", str(manifest))
    else:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))


def ready(cluster: Cluster, namespace: str, name: str, timeout: float = 90) -> None:
    cluster.kubectl(
        "wait",
        "-n",
        namespace,
        f"omnip/{name}",
        "--for=condition=Ready",
        f"--timeout={int(timeout)}s",
        timeout=timeout + 10,
    )


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def test_apply_creates_labelled_owned_children_matching_render(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    apply(cluster, namespace, EXAMPLE)
    found = wait_for(
        "all children",
        lambda: (c := children(cluster, namespace, "qwen-image")) and set(c) == EXPECTED and c,
    )
    found.update(policies(cluster, namespace, "qwen-image"))
    owner = get_json(cluster, "omnip", "qwen-image", "-n", namespace)
    for (_kind, name), obj in found.items():
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "omnipipe-operator", name
        assert labels["app.kubernetes.io/instance"] == "qwen-image"
        [ref] = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == (
            "OmniPipeline",
            owner["metadata"]["uid"],
            True,
        )
    # `omnipipe render` shows exactly what the operator applied.
    rendered = subprocess.run(
        [sys.executable, "-m", "omnipipe.cli", "render", str(EXAMPLE), "-n", namespace],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for doc in yaml.safe_load_all(rendered):
        live = found[(doc["kind"], doc["metadata"]["name"])]
        managed = [
            f for f in live["metadata"]["managedFields"] if f["manager"] == "omnipipe-operator"
        ]
        assert managed
        assert managed[0]["operation"] == "Apply"
        assert _subset(
            doc["spec"] if "spec" in doc else doc["data"],
            live["spec"] if "spec" in live else live["data"],
        ), doc["metadata"]["name"]


def policies(cluster: Cluster, namespace: str, pipeline: str) -> dict[tuple[str, str], Any]:
    items = get_json(
        cluster,
        "networkpolicies",
        "-n",
        namespace,
        "-l",
        f"omnipipe.io/pipeline={pipeline}",
        "--show-managed-fields",
    )["items"]
    return {("NetworkPolicy", i["metadata"]["name"]): i for i in items}


def _subset(want: Any, have: Any) -> bool:
    if isinstance(want, dict):
        # The API server omits false and empty values it stores as defaults.
        return isinstance(have, dict) and all(
            _subset(v, have[k]) if k in have else v in (False, None, {}, [])
            for k, v in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(_subset(w, h) for w, h in zip(want, have, strict=True))
        )
    return bool(want == have or str(want) == str(have))


def test_status_becomes_ready_with_kwok_pods_and_printer_columns(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    apply(cluster, namespace, EXAMPLE)
    ready(cluster, namespace, "qwen-image")

    def scaling_reported() -> dict[str, Any] | None:
        # The autoscale timer writes ScalingActive; pods can be Ready before its first pass.
        obj: dict[str, Any] = get_json(cluster, "omnip", "qwen-image", "-n", namespace)
        types = {c["type"] for c in obj["status"]["conditions"]}
        return obj if "ScalingActive" in types else None

    obj = wait_for("the ScalingActive condition", scaling_reported)
    status = obj["status"]
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds.pop("Progressing")["status"] == "False"
    for ready_type in (
        "Ready",
        "StagesReady",
        "RouterReady",
        "StageEncodeReady",
        "StageDenoiseReady",
        "StageDecodeReady",
    ):
        assert conds.pop(ready_type)["status"] == "True", ready_type
    capacity = conds.pop("StagesAtCapacity")
    assert (capacity["status"], capacity["reason"]) == ("True", "AllStagesAtCapacity")
    # kstatus (Flux) reads these two: Current needs both False.
    reconciling, stalled = conds.pop("Reconciling"), conds.pop("Stalled")
    assert (reconciling["status"], reconciling["reason"]) == ("False", "Reconciled")
    assert (stalled["status"], stalled["reason"]) == ("False", "NotStalled")
    generation = obj["metadata"]["generation"]
    assert {reconciling["observedGeneration"], stalled["observedGeneration"]} == {generation}
    # The example autoscales denoise; this cluster has no Prometheus, and status says so.
    scaling = conds.pop("ScalingActive")
    assert (scaling["status"], scaling["reason"]) == ("False", "PrometheusUnavailable")
    assert conds == {}
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    assert {s["name"]: s["readyReplicas"] for s in status["stages"]} == {
        "encode": 1,
        "denoise": 1,
        "decode": 1,
    }
    endpoint = f"http://qwen-image-router.{namespace}.svc:8000/v1"
    table = cluster.kubectl("get", "omnip", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "STAGES", "READY", "REASON", "ENDPOINT", "AGE"]
    row = table[1].split()
    assert row[:6] == ["qwen-image", "Qwen/Qwen-Image", "3/3", "True", "Serving", endpoint]
    # The rollout's columns are kubectl's wide ones.
    wide = cluster.kubectl("get", "omnip", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert wide[0].split()[5:8] == ["PROGRESSING", "CURRENT", "UPDATE"]
    assert wide[1].split()[5:8] == ["False", REV, REV]
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=OmniPipeline"
    ).stdout
    assert "Created" in events


def test_editing_one_stage_rolls_only_that_stage(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    manifest = example()
    apply(cluster, namespace, manifest)
    ready(cluster, namespace, "qwen-image")
    before = {
        k: v["metadata"]["generation"]
        for k, v in children(cluster, namespace, "qwen-image").items()
        if k[0] == "Deployment"
    }
    edited = copy.deepcopy(manifest)
    # Resources roll in place: same revision, so only that stage's pods change.
    edited["spec"]["stages"][0]["resources"] = {"cpu": "3"}
    assert revision(edited) == REV
    apply(cluster, namespace, edited)

    def generations() -> dict[tuple[str, str], int] | None:
        now = {
            k: v["metadata"]["generation"]
            for k, v in children(cluster, namespace, "qwen-image").items()
            if k[0] == "Deployment"
        }
        return now if now != before else None

    after = wait_for("the denoise Deployment to change", generations)
    changed = {k for k in after if after[k] != before[k]}
    assert changed == {("Deployment", f"qwen-image-denoise-{REV}")}
    config = get_json(cluster, "configmap", f"qwen-image-config-{REV}", "-n", namespace)
    assert "cpu: '3'" in config["data"]["pipeline.yaml"]
    ready(cluster, namespace, "qwen-image")


def _custom(stages: list[str]) -> dict[str, Any]:
    specs = [{"name": "a", "role": "text-encoder", "engine": "transformers"}]
    for prev, name in itertools.pairwise(stages):
        specs.append({"name": name, "role": "denoiser", "engine": "diffusers", "inputs": [prev]})
    return {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "chain"},
        "spec": {
            "model": "tiny://qwen-image",
            "pipeline": "custom",
            "stages": specs[: len(stages)],
        },
    }


def test_removing_a_stage_deletes_its_children(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    three, two = _custom(["a", "b", "c"]), _custom(["a", "b"])
    apply(cluster, namespace, three)
    wait_for(
        "chain-c",
        lambda: (
            ("Deployment", f"chain-c-{revision(three)}") in children(cluster, namespace, "chain")
        ),
    )
    # A changed stage graph is a new revision: the old one, c included, goes once the
    # new one is ready.
    apply(cluster, namespace, two)
    wait_for(
        "chain-c to be deleted",
        lambda: (
            not any(
                name == "chain-c" or name.startswith("chain-c-")
                for _, name in children(cluster, namespace, "chain")
            )
        ),
        timeout=90,
    )
    left = children(cluster, namespace, "chain")
    assert {("Deployment", f"chain-{s}-{revision(two)}") for s in "ab"} <= set(left)
    assert ("Service", "chain-c") not in left


def test_hpa_mode_creates_an_hpa_and_native_mode_prunes_it(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    manifest = example()
    manifest["spec"]["stages"][0]["autoscaling"]["mode"] = "hpa"
    apply(cluster, namespace, manifest)
    hpa = wait_for(
        "the HPA",
        lambda: (
            ("HorizontalPodAutoscaler", "qwen-image-denoise")
            in (kids := children(cluster, namespace, "qwen-image"))
            and kids
        ),
    )
    assert hpa[("HorizontalPodAutoscaler", "qwen-image-denoise")]["spec"]["maxReplicas"] == 6
    apply(cluster, namespace, example())  # back to the operator's own autoscaler
    wait_for(
        "the HPA to be pruned",
        lambda: (
            ("HorizontalPodAutoscaler", "qwen-image-denoise")
            not in children(cluster, namespace, "qwen-image")
        ),
    )


def test_deleting_the_pipeline_garbage_collects_everything(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    apply(cluster, namespace, EXAMPLE)
    wait_for("children", lambda: set(children(cluster, namespace, "qwen-image")) == EXPECTED)
    cluster.kubectl("delete", "-n", namespace, "omnip/qwen-image", "--wait=true")
    wait_for(
        "garbage collection",
        lambda: (
            not children(cluster, namespace, "qwen-image")
            and not get_json(cluster, "pods", "-n", namespace)["items"]
        ),
        timeout=90,
    )


def test_operator_exports_metrics(cluster: Cluster, operator: Operator, namespace: str) -> None:
    apply(cluster, namespace, EXAMPLE)
    ready(cluster, namespace, "qwen-image")
    url = f"http://127.0.0.1:{operator.metrics_port}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())

    denoise = {"namespace": namespace, "pipeline": "qwen-image", "stage": "denoise"}
    # The gauge itself, not any series of the namespace: those exist from the first
    # reconcile on, when no replica is ready yet. Its last value is in the timeout message.
    ready_replicas = wait_for(
        "omnipipe_stage_replicas_ready of the denoise stage above 0",
        lambda: sample(scrape(), "omnipipe_stage_replicas_ready", denoise),
    )
    assert ready_replicas == 1.0
    text = scrape()
    assert 'omnipipe_operator_reconcile_total{result="success",trigger="create"}' in text
    assert "omnipipe_operator_reconcile_duration_seconds_bucket" in text


def sample(text: str, name: str, labels: dict[str, str]) -> float | None:
    """One series' value in a /metrics page; None when it is absent."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


def test_operator_killed_mid_reconcile_converges_without_duplicates(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    operator.kill()
    try:
        apply(cluster, namespace, EXAMPLE)
        operator.start()
        # Kill it as soon as it has written its first child: mid-reconcile.
        wait_for("a first child", lambda: children(cluster, namespace, "qwen-image"), timeout=60)
        operator.kill()
        partial = set(children(cluster, namespace, "qwen-image"))
        assert partial <= EXPECTED
    finally:
        operator.start()
    ready(cluster, namespace, "qwen-image")
    assert set(children(cluster, namespace, "qwen-image")) == EXPECTED
    replicasets = get_json(cluster, "replicasets", "-n", namespace)["items"]
    per_stage = [
        rs["metadata"]["labels"]["omnipipe.io/stage"]
        for rs in replicasets
        if "omnipipe.io/stage" in rs["metadata"]["labels"]
    ]
    assert sorted(per_stage) == ["decode", "denoise", "encode"], "a pod template was re-rolled"
    pods = get_json(cluster, "pods", "-n", namespace)["items"]
    assert len(pods) == 4


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_invalid_manifest_rejected_by_kubectl_apply(cluster: Cluster, case: Invalid) -> None:
    proc = cluster.kubectl(
        "apply", "-n", "default", "-f", "-", input=yaml.safe_dump(case.make()), check=False
    )
    assert proc.returncode != 0, f"{case.id} was accepted"
    assert case.kube in proc.stderr, proc.stderr


def test_kubectl_explain_shows_descriptions(cluster: Cluster) -> None:
    out = cluster.kubectl("explain", "omnipipeline.spec.stages").stdout
    assert "Stage overrides and additions, keyed by name." in out
    for field in ("engineArgs", "autoscaling", "resources", "inputs"):
        assert field in out
    deep = cluster.kubectl("explain", "omnip.spec.stages.resources.gpus").stdout
    assert "nvidia.com/gpu" in deep


def test_operator_service_account_is_least_privilege(cluster: Cluster) -> None:
    def can(*args: str) -> bool:
        return operator_can(cluster, *args)

    assert can("patch", "deployments", "-A")
    assert can("patch", "omnipipelines.omnipipe.io/status", "-A")
    assert can("patch", "networkpolicies.networking.k8s.io", "-A")
    # Pipeline credentials: created once, never read, listed or rewritten.
    assert can("create", "secrets", "-A")
    for verb in ("list", "watch", "patch", "update", "delete"):
        assert not can(verb, "secrets", "-A"), verb
    assert not can("get", "secrets", "-A")
    assert not can("create", "pods", "-A")
    assert not can("delete", "omnipipelines.omnipipe.io", "-A")
    assert not can("create", "clusterrolebindings")


def _credential(cluster: Cluster, namespace: str) -> dict[str, Any]:
    return dict(get_json(cluster, "secret", "qwen-image-credential", "-n", namespace))


def test_the_credential_secret_is_created_once_and_every_pod_reads_it(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    manifest = example()
    apply(cluster, namespace, manifest)
    ready(cluster, namespace, "qwen-image")
    secret = _credential(cluster, namespace)
    value = base64.b64decode(secret["data"]["credential"])
    assert len(value) >= 32
    owner = get_json(cluster, "omnip", "qwen-image", "-n", namespace)
    [ref] = secret["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"]) == ("OmniPipeline", owner["metadata"]["uid"])
    assert secret["metadata"]["labels"]["omnipipe.io/pipeline"] == "qwen-image"

    pods = get_json(cluster, "pods", "-n", namespace)["items"]
    assert len(pods) == 4
    for pod in pods:
        [container] = pod["spec"]["containers"]
        [env] = [e for e in container["env"] if e["name"] == "OMNIPIPE_PIPELINE_CREDENTIAL"]
        assert env["valueFrom"]["secretKeyRef"] == {
            "name": "qwen-image-credential",
            "key": "credential",
        }, pod["metadata"]["name"]

    # An edit (a reconcile) and the drift timer's re-applies (every 3 s here) leave it be.
    edited = copy.deepcopy(manifest)
    edited["spec"]["stages"][0]["resources"] = {"cpu": "3"}
    apply(cluster, namespace, edited)
    wait_for(
        "the edit to be reconciled",
        lambda: (
            "cpu: '3'"
            in get_json(cluster, "configmap", f"qwen-image-config-{REV}", "-n", namespace)["data"][
                "pipeline.yaml"
            ]
        ),
    )
    time.sleep(7)  # two drift passes
    again = _credential(cluster, namespace)
    assert again["data"] == secret["data"]
    assert again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]

    # Deleting it is how to rotate it: the next pass creates a fresh one.
    cluster.kubectl("delete", "-n", namespace, "secret", "qwen-image-credential")
    rotated = wait_for(
        "a new credential",
        lambda: (
            cluster.kubectl(
                "get", "secret", "qwen-image-credential", "-n", namespace, check=False
            ).returncode
            == 0
            and _credential(cluster, namespace)
        ),
        timeout=30,
    )
    assert rotated["data"]["credential"] != secret["data"]["credential"]


def test_the_stage_pods_are_fenced_by_a_network_policy(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    apply(cluster, namespace, EXAMPLE)
    found = wait_for("the NetworkPolicy", lambda: policies(cluster, namespace, "qwen-image"))
    policy = found[("NetworkPolicy", "qwen-image-stages")]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    ready(cluster, namespace, "qwen-image")
    pods = get_json(
        cluster, "pods", "-n", namespace, "-l", ",".join(f"{k}={v}" for k, v in selector.items())
    )["items"]
    # It selects the three stages' pods and not the router's.
    assert sorted(p["metadata"]["labels"]["omnipipe.io/stage"] for p in pods) == [
        "decode",
        "denoise",
        "encode",
    ]
    ports = [r.get("ports") for r in policy["spec"]["ingress"]]
    assert ports[0] == [{"port": 8100, "protocol": "TCP"}]


# ---- revisions: a model change rolls out beside the old stages, then replaces them ----


def _status(cluster: Cluster, namespace: str) -> dict[str, Any]:
    return dict(get_json(cluster, "omnip", "qwen-image", "-n", namespace).get("status") or {})


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions", [])}


def _revision_labels(cluster: Cluster, namespace: str, kind: str) -> dict[str, str]:
    items = get_json(
        cluster, kind, "-n", namespace, "-l", "omnipipe.io/pipeline=qwen-image,omnipipe.io/stage"
    )["items"]
    # "" for what predates revisions (it has no such label).
    return {
        i["metadata"]["name"]: i["metadata"]["labels"].get("omnipipe.io/revision", "")
        for i in items
    }


def _events(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    items = get_json(
        cluster, "events", "-n", namespace, "--field-selector", "involvedObject.kind=OmniPipeline"
    )["items"]
    return list(items)


def _reasons(cluster: Cluster, namespace: str) -> list[str]:
    return [e["reason"] for e in _events(cluster, namespace)]


def _rolled_to(cluster: Cluster, namespace: str, rev: str) -> bool:
    status = _status(cluster, namespace)
    return (
        status.get("currentRevision") == rev
        and status.get("updateRevision") == rev
        and _conditions(status).get("Progressing", {}).get("status") == "False"
        and set(_revision_labels(cluster, namespace, "deployments").values()) == {rev}
        and set(_revision_labels(cluster, namespace, "pods").values()) == {rev}
    )


def test_model_change_rolls_out_a_revision_then_rollback_and_in_place_change(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    manifest = example()
    apply(cluster, namespace, manifest)
    ready(cluster, namespace, "qwen-image")
    wait_for("revision REV to serve", lambda: _rolled_to(cluster, namespace, REV))
    # The autoscaler owns denoise's count (no Prometheus here, so it holds it).
    cluster.kubectl(
        "scale", "-n", namespace, f"deployment/qwen-image-denoise-{REV}", "--replicas=2"
    )
    wait_for(
        "2 denoise pods",
        lambda: list(_revision_labels(cluster, namespace, "pods").values()).count(REV) == 4,
    )

    # A model change, with encode's new pods held Pending (a node nobody has) so the
    # rollout can be watched half-way.
    changed = copy.deepcopy(manifest)
    changed["spec"]["model"] = "Qwen/Qwen-Image-2512"
    changed["spec"]["stages"].append(
        {"name": "encode", "nodeSelector": {"omnipipe.test/node": "nowhere"}}
    )
    rev2 = revision(changed)
    assert rev2 != REV
    apply(cluster, namespace, changed)

    def half_way() -> dict[str, Any] | None:
        status = _status(cluster, namespace)
        revisions = {r["revision"]: r for r in status.get("revisions", [])}
        ok = (
            status.get("currentRevision") == REV
            and status.get("updateRevision") == rev2
            and _conditions(status)["Progressing"]["status"] == "True"
            and revisions.get(rev2, {}).get("stagesReady") == "2/3"
        )
        return status if ok else None

    status = wait_for("the new revision to be 2/3 ready beside the old", half_way)
    conds = _conditions(status)
    # The old revision still serves: the pipeline stays Ready throughout.
    assert conds["Ready"]["status"] == "True"
    assert conds["Progressing"]["reason"] == "RollingOut"
    assert [(r["revision"], r["stagesReady"], r["ready"]) for r in status["revisions"]] == [
        (rev2, "2/3", False),
        (REV, "3/3", True),
    ]
    deployments = _revision_labels(cluster, namespace, "deployments")
    assert deployments == {
        **{f"qwen-image-{s}-{REV}": REV for s in STAGES},
        **{f"qwen-image-{s}-{rev2}": rev2 for s in STAGES},
    }
    # Autoscaled denoise starts from the old revision's current count, not its minimum.
    new_denoise = get_json(cluster, "deployment", f"qwen-image-denoise-{rev2}", "-n", namespace)
    assert new_denoise["spec"]["replicas"] == 2
    # Each revision reads its own ConfigMap.
    for rev, model in ((REV, "Qwen/Qwen-Image"), (rev2, "Qwen/Qwen-Image-2512")):
        config = get_json(cluster, "configmap", f"qwen-image-config-{rev}", "-n", namespace)
        assert f"model: {model}\n" in config["data"]["pipeline.yaml"]
    table = cluster.kubectl("get", "omnip", "-n", namespace, "-o", "wide").stdout.splitlines()
    print("\n".join(table))  # the README shows this table (pytest -s)
    assert table[1].split()[2:8] == ["3/3", "True", "Serving", "True", REV, rev2]
    assert "RolloutStarted" in _reasons(cluster, namespace)
    assert "RevisionSwitched" not in _reasons(cluster, namespace)

    # An in-place fix of the new revision (placement is not part of it) lets it finish.
    del changed["spec"]["stages"][-1]
    assert revision(changed) == rev2
    apply(cluster, namespace, changed)
    wait_for("revision 2 to serve alone", lambda: _rolled_to(cluster, namespace, rev2), timeout=90)
    print(cluster.kubectl("get", "omnip", "-n", namespace, "-o", "wide").stdout)
    assert not any(name.endswith(REV) for _, name in children(cluster, namespace, "qwen-image")), (
        "the old revision's children were not deleted"
    )
    reasons = _reasons(cluster, namespace)
    assert {"RevisionSwitched", "RevisionRetired"} <= set(reasons)
    messages = [e["message"] for e in _events(cluster, namespace)]
    assert any(f"requests now start on it instead of revision {REV}" in m for m in messages)

    # Rolling back is the same rollout in reverse, to a fresh set of REV workloads.
    apply(cluster, namespace, manifest)
    wait_for("the rollback to REV", lambda: _rolled_to(cluster, namespace, REV), timeout=90)
    assert set(children(cluster, namespace, "qwen-image")) == EXPECTED
    assert reasons.count("RolloutStarted") < _reasons(cluster, namespace).count("RolloutStarted")

    # An in-place change (a fixed replica count) keeps the revision and its Deployment.
    before = _reasons(cluster, namespace).count("RolloutStarted")
    scaled = copy.deepcopy(manifest)
    scaled["spec"]["stages"].append({"name": "encode", "replicas": 2})
    apply(cluster, namespace, scaled)
    wait_for(
        "encode at 2 replicas in place",
        lambda: (
            get_json(cluster, "deployment", f"qwen-image-encode-{REV}", "-n", namespace)["spec"][
                "replicas"
            ]
            == 2
        ),
    )
    ready(cluster, namespace, "qwen-image")
    assert _rolled_to(cluster, namespace, REV)
    assert _reasons(cluster, namespace).count("RolloutStarted") == before


def _legacy_children(namespace: str) -> list[dict[str, Any]]:
    """What an omnipipe before revisions made: `P-<stage>` Deployments and `P-config`,
    labelled as it labelled them, with no revision label."""
    common = {
        "app.kubernetes.io/name": "omnipipe",
        "app.kubernetes.io/instance": "qwen-image",
        "app.kubernetes.io/managed-by": "omnipipe-operator",
        "omnipipe.io/pipeline": "qwen-image",
    }
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "qwen-image-config",
            "namespace": namespace,
            "labels": {**common, "app.kubernetes.io/component": "config"},
        },
        "data": {"pipeline.yaml": "model: Qwen/Qwen-Image\n"},
    }
    deployments = []
    for stage in STAGES:
        selector = {"omnipipe.io/pipeline": "qwen-image", "omnipipe.io/stage": stage}
        labels = {**common, "app.kubernetes.io/component": "stage", **selector}
        deployments.append(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {
                    "name": f"qwen-image-{stage}",
                    "namespace": namespace,
                    "labels": labels,
                },
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": selector},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "containers": [{"name": "worker", "image": "omnipipe-worker:old"}]
                        },
                    },
                },
            }
        )
    return [config, *deployments]


def test_an_upgrade_from_before_revisions_keeps_the_old_deployments_until_the_switch(
    cluster: Cluster, operator: Operator, namespace: str
) -> None:
    legacy = _legacy_children(namespace)
    for obj in legacy:
        apply(cluster, namespace, obj)
    legacy_names = {(o["kind"], o["metadata"]["name"]) for o in legacy}
    wait_for(
        "the old stage pods to be ready",
        lambda: all(
            get_json(cluster, "deployment", f"qwen-image-{s}", "-n", namespace)
            .get("status", {})
            .get("readyReplicas")
            == 1
            for s in STAGES
        ),
    )

    # The upgraded operator meets them, with encode's new pods held Pending.
    manifest = example()
    held = copy.deepcopy(manifest)
    held["spec"]["stages"].append(
        {"name": "encode", "nodeSelector": {"omnipipe.test/node": "nowhere"}}
    )
    assert revision(held) == REV
    apply(cluster, namespace, held)

    def serving_legacy() -> dict[str, Any] | None:
        status = _status(cluster, namespace)
        revisions = {r["revision"]: r for r in status.get("revisions", [])}
        ok = (
            status.get("currentRevision") == "legacy"
            and status.get("updateRevision") == REV
            and revisions.get(REV, {}).get("stagesReady") == "2/3"
            # The router is new (the old operator made none), so its pod may come up
            # after the new revision's stages do.
            and _conditions(status).get("RouterReady", {}).get("status") == "True"
        )
        return status if ok else None

    status = wait_for("the new revision 2/3 ready beside the old Deployments", serving_legacy)
    conds = _conditions(status)
    assert conds["Ready"]["status"] == "True", conds
    assert conds["Progressing"]["reason"] == "RollingOut"
    # Nothing of the old one was deleted: it still serves.
    time.sleep(3)
    assert legacy_names <= set(children(cluster, namespace, "qwen-image"))

    # Released: the new revision becomes ready, takes over, and the old objects go.
    apply(cluster, namespace, manifest)
    wait_for("REV to serve alone", lambda: _rolled_to(cluster, namespace, REV), timeout=90)
    assert set(children(cluster, namespace, "qwen-image")) == EXPECTED
    reasons = _reasons(cluster, namespace)
    assert {"RolloutStarted", "RevisionSwitched", "RevisionRetired"} <= set(reasons)
    messages = [e["message"] for e in _events(cluster, namespace)]
    assert any("instead of revision legacy" in m for m in messages), messages
