"""examples/gitops as Flux or Argo CD would apply it: the overlays render and pass the API
server's dry run, a second apply of the chart and the examples changes nothing once the
operator has reconciled, the operator owns no field of the user's manifest, and bad
input in Git fails the apply with the field's path."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.cluster import BIN, Cluster
from tests.harness.gitops import HEALTH_LUA, kstatus
from tests.integration.conftest import REPO, Operator, children, get_json, wait_for
from tests.invalid_manifests import CASES, Invalid

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

Manifest = dict[str, Any]
GITOPS = REPO / "examples/gitops"
CHART = REPO / "charts/omnipipe"
KUBE_VERSION = "1.34.4"
# `kubectl apply --server-side`'s field manager: the applier, as Flux's
# kustomize-controller or Argo CD's is in a cluster that they sync.
APPLIER = "kubectl"
# The prefix of the annotations the operator keeps on a pipeline (kopf's state).
OPERATOR_ANNOTATIONS = "omnipipe.io/"
# kopf's own entry in the finalizers set, there while its timers run on a pipeline: an
# entry of a set, so it never contends with one a user's manifest might list.
KOPF_FINALIZER = ("f:metadata", "f:finalizers", 'v:"kopf.zalando.org/KopfFinalizerMarker"')
CRD = "omnipipelines.omnipipe.io"
# The CRD the shared test cluster runs (the `cluster` fixture applies it).
LIVE_CRD = REPO / "crds" / f"{CRD}.yaml"
PIPELINE = "tiny-image"


@dataclass(frozen=True)
class Overlay:
    name: str
    namespace: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: Manifest  # the pipeline's whole spec as the overlay renders it


OVERLAYS = [
    Overlay(
        "staging",
        "omnipipe-staging",
        {"omnipipe.example.com/environment": "staging"},
        {"omnipipe.example.com/owner": "ml-platform"},
        {
            "model": "tiny://qwen-image",
            "pipeline": "qwen-image",
            "stages": [
                {"name": "denoise", "maxBatch": 2, "resources": {"cpu": "2", "memory": "4Gi"}}
            ],
        },
    ),
    Overlay(
        "production",
        "omnipipe-production",
        {"omnipipe.example.com/environment": "production"},
        {"omnipipe.example.com/owner": "ml-platform"},
        {
            "model": "tiny://qwen-image",
            "pipeline": "qwen-image",
            "router": {"replicas": 2},
            "stages": [
                {
                    "name": "denoise",
                    "resources": {"cpu": "4", "memory": "8Gi"},
                    "autoscaling": {
                        "minReplicas": 2,
                        "maxReplicas": 8,
                        "metric": "inflight",
                        "target": 2,
                    },
                }
            ],
        },
    ),
]
PRODUCTION = OVERLAYS[1]


def run(*argv: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(argv)}:\n{proc.stdout}{proc.stderr}"
    return proc


def kustomize(path: Path) -> list[Manifest]:
    out = run(str(BIN / "kubectl"), "kustomize", str(path)).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def for_shared_cluster(path: Path) -> list[Manifest]:
    """A kustomization's objects, to apply to the cluster that other tests share: a stale
    copy of the CRD would replace the one they run against (and restart the operator's
    watches)."""
    docs = kustomize(path)
    crd = one(docs, "CustomResourceDefinition")
    assert crd == yaml.safe_load(LIVE_CRD.read_text()), f"{path}: not the CRD in crds/"
    return docs


def dump(docs: list[Manifest]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


def key(obj: Manifest) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def one(docs: list[Manifest], kind: str) -> Manifest:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def live_or_none(cluster: Cluster, namespace: str, name: str) -> Manifest | None:
    proc = cluster.kubectl("get", "omnip", name, "-n", namespace, "-o", "json", check=False)
    if proc.returncode != 0:
        assert "NotFound" in proc.stderr, proc.stderr
        return None
    found: Manifest = json.loads(proc.stdout)
    return found


# -- the repository's files, without a cluster --------------------------------------------


@pytest.mark.parametrize(
    ("copy_", "source"),
    [
        (
            "base/omnipipelines.omnipipe.io.yaml",
            "charts/omnipipe/crds/omnipipelines.omnipipe.io.yaml",
        ),
        ("base/tiny-text-to-image.yaml", "examples/tiny-text-to-image.yaml"),
    ],
)
def test_base_copies_have_not_drifted_from_their_sources(copy_: str, source: str) -> None:
    assert (GITOPS / copy_).read_bytes() == (REPO / source).read_bytes(), (
        f"examples/gitops/{copy_} differs from {source}: cp {source} examples/gitops/{copy_}"
    )


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: o.name)
def test_overlay_renders_its_namespace_labels_and_spec_and_leaves_the_crd(
    overlay: Overlay,
) -> None:
    docs = kustomize(GITOPS / "overlays" / overlay.name)
    assert sorted(key(d) for d in docs) == [
        ("CustomResourceDefinition", "", CRD),
        ("Namespace", "", overlay.namespace),
        ("OmniPipeline", overlay.namespace, PIPELINE),
    ]
    # The CRD is cluster-wide: every overlay ships the base's, untouched.
    base_crd = yaml.safe_load((GITOPS / "base" / f"{CRD}.yaml").read_text())
    assert one(docs, "CustomResourceDefinition") == base_crd
    assert one(docs, "OmniPipeline") == {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {
            "name": PIPELINE,
            "namespace": overlay.namespace,
            "labels": overlay.labels,
            "annotations": overlay.annotations,
        },
        "spec": overlay.spec,
    }
    base = one(kustomize(GITOPS / "base"), "OmniPipeline")
    assert {k: overlay.spec[k] for k in base["spec"]} == base["spec"]


def test_flux_kustomizations_wait_for_the_overlays() -> None:
    docs = [d for d in yaml.safe_load_all((GITOPS / "flux/sync.yaml").read_text()) if d]
    [source] = [d for d in docs if d["kind"] == "GitRepository"]
    assert source["apiVersion"] == "source.toolkit.fluxcd.io/v1"
    assert source["spec"]["url"]
    assert source["spec"]["ref"]["branch"]
    syncs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Kustomization"}
    assert set(syncs) == {f"omnipipe-{o.name}" for o in OVERLAYS}
    for overlay in OVERLAYS:
        sync = syncs[f"omnipipe-{overlay.name}"]
        spec = sync["spec"]
        assert sync["apiVersion"] == "kustomize.toolkit.fluxcd.io/v1"
        assert spec["path"] == f"./examples/gitops/overlays/{overlay.name}"
        assert (REPO / spec["path"] / "kustomization.yaml").is_file()
        assert spec["sourceRef"] == {"kind": "GitRepository", "name": source["metadata"]["name"]}
        assert (spec["wait"], spec["prune"]) == (True, True)
        assert spec["interval"]
        assert spec["timeout"]
    assert syncs["omnipipe-production"]["spec"]["dependsOn"] == [{"name": "omnipipe-staging"}]


def test_argocd_applications_sync_the_overlays_server_side() -> None:
    docs = [d for d in yaml.safe_load_all((GITOPS / "argocd/application.yaml").read_text()) if d]
    apps = {d["metadata"]["name"]: d for d in docs}
    assert set(apps) == {f"omnipipe-{o.name}" for o in OVERLAYS}
    for overlay in OVERLAYS:
        app = apps[f"omnipipe-{overlay.name}"]
        assert (app["apiVersion"], app["kind"]) == ("argoproj.io/v1alpha1", "Application")
        spec = app["spec"]
        assert spec["source"]["path"] == f"examples/gitops/overlays/{overlay.name}"
        assert (REPO / spec["source"]["path"] / "kustomization.yaml").is_file()
        assert spec["source"]["repoURL"]
        assert spec["source"]["targetRevision"]
        assert spec["destination"]["namespace"] == overlay.namespace
        assert spec["syncPolicy"]["automated"] == {"prune": True, "selfHeal": True}
        assert "ServerSideApply=true" in spec["syncPolicy"]["syncOptions"]
    health = yaml.safe_load((GITOPS / "argocd/health.yaml").read_text())
    assert (health["kind"], health["metadata"]["name"]) == ("ConfigMap", "argocd-cm")
    lua = health["data"]["resource.customizations.health.omnipipe.io_OmniPipeline"]
    # The chart's own check, which test_health_checks.py runs in Argo CD's Lua runtime.
    assert lua == HEALTH_LUA.read_text(), "run `make manifests` (hack/gitops-example.py)"


# -- the overlays against the API server ---------------------------------------------------


@pytest.fixture(scope="module")
def overlay_namespaces(cluster: Cluster) -> Iterator[None]:
    """The overlays' own namespaces exist for this module and go with it."""
    yield
    for overlay in OVERLAYS:
        cluster.kubectl("delete", "namespace", overlay.namespace, "--wait=false", check=False)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda o: o.name)
def test_overlay_passes_the_api_servers_dry_run_and_keeps_every_field(
    cluster: Cluster, overlay_namespaces: None, overlay: Overlay
) -> None:
    docs = for_shared_cluster(GITOPS / "overlays" / overlay.name)
    # A dry run creates nothing, its namespace included: the namespace is applied first,
    # as Flux does with namespaces and CRDs.
    cluster.kubectl("apply", "--server-side", "-f", "-", input=dump([one(docs, "Namespace")]))
    before = live_or_none(cluster, overlay.namespace, PIPELINE)
    proc = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-o", "json", "-f", "-", input=dump(docs)
    )
    result = json.loads(proc.stdout)
    returned = {key(i): i for i in result["items"]}
    assert set(returned) == {key(d) for d in docs}
    pipeline = returned[("OmniPipeline", overlay.namespace, PIPELINE)]
    # Nothing pruned, nothing defaulted: the server keeps the overlay's spec as written.
    assert pipeline["spec"] == overlay.spec
    assert pipeline["metadata"]["labels"] == overlay.labels
    assert pipeline["metadata"]["annotations"] == overlay.annotations
    after = live_or_none(cluster, overlay.namespace, PIPELINE)
    if before is None:
        assert after is None, "the dry run created the pipeline"
    else:
        assert after is not None
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


# -- bad input in Git ----------------------------------------------------------------------

# Server-side apply reports some errors in its own words: an unknown field is "not
# declared in schema", and a stage is named by its key, not its index. Each names the
# field's path.
BAD = {
    "unknown-engine": 'spec.stages[0].engine: Unsupported value: "tensorrt"',
    "negative-replicas": "spec.stages[0].replicas: Invalid value: -1",
    "bad-memory-quantity": "spec.stages[0].resources.memory: Invalid value",
    "unknown-field": '.spec.stages[name="denoise"].gpu: field not declared in schema',
    "hub-token-in-the-spec": ".spec.weights.token: field not declared in schema",
    "min-above-max": "spec.stages[0].autoscaling.minReplicas: Invalid value",
}


@pytest.mark.parametrize("case", [c for c in CASES if c.id in BAD], ids=lambda c: c.id)
def test_bad_manifest_fails_server_side_apply_with_the_field_path(
    cluster: Cluster, namespace: str, case: Invalid
) -> None:
    proc = cluster.kubectl(
        "apply",
        "--server-side",
        "-n",
        namespace,
        "-f",
        "-",
        input=dump([case.make()]),
        check=False,
    )
    assert proc.returncode != 0, f"{case.id} was accepted"
    assert BAD[case.id] in proc.stderr, proc.stderr
    assert live_or_none(cluster, namespace, "bad") is None


def test_bad_commit_on_an_overlay_fails_and_leaves_the_running_pipeline(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """A commit that breaks the staging overlay: the apply fails naming the field, and the
    pipeline that runs keeps its spec and generation."""
    good = tmp_path / "good"
    good.mkdir()
    (good / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": namespace,
                "resources": [os.path.relpath(GITOPS / "base", good)],
            }
        )
    )
    cluster.kubectl("apply", "--server-side", "-f", "-", input=dump(for_shared_cluster(good)))
    running = get_json(cluster, "omnip", PIPELINE, "-n", namespace)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(good, bad)],
                "patches": [{"path": "typo.yaml"}],
            }
        )
    )
    # `minReplica` for `minReplicas`: the kind of typo a review misses.
    (bad / "typo.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": PIPELINE},
                "spec": {
                    "stages": [
                        {"name": "denoise", "autoscaling": {"minReplica": 2, "maxReplicas": 4}}
                    ]
                },
            }
        )
    )
    proc = cluster.kubectl(
        "apply", "--server-side", "-f", "-", input=dump(for_shared_cluster(bad)), check=False
    )
    assert proc.returncode != 0
    path = '.spec.stages[name="denoise"].autoscaling.minReplica'
    assert f"{path}: field not declared in schema" in proc.stderr, proc.stderr
    now = get_json(cluster, "omnip", PIPELINE, "-n", namespace)
    assert now["metadata"]["generation"] == running["metadata"]["generation"]
    assert now["spec"] == running["spec"]


# -- no drift: apply, let the operator reconcile, apply again ------------------------------


@dataclass(frozen=True)
class Deployed:
    docs: list[Manifest]  # everything applied, in order
    pipelines: list[tuple[str, str]]  # (namespace, name)


def chart_docs(namespace: str) -> list[Manifest]:
    out = run(
        str(BIN / "helm"),
        "template",
        "gitops-omnipipe",
        str(CHART),
        "-n",
        namespace,
        "--include-crds",
        "--kube-version",
        KUBE_VERSION,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def namespace_doc(name: str) -> Manifest:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def reconciled(cluster: Cluster, namespace: str, name: str) -> bool:
    obj = get_json(cluster, "omnip", name, "-n", namespace)
    status = obj.get("status", {})
    ready = {c["type"]: c["status"] for c in status.get("conditions", [])}.get("Ready")
    return (
        status.get("observedGeneration") == obj["metadata"]["generation"]
        and ready == "True"
        and bool(children(cluster, namespace, name))
    )


def rolled_out(cluster: Cluster, namespace: str, name: str) -> bool:
    dep = get_json(cluster, "deployment", name, "-n", namespace)
    st, want = dep.get("status", {}), dep["spec"]["replicas"]
    return bool(
        st.get("observedGeneration") == dep["metadata"]["generation"]
        and st.get("updatedReplicas") == want
        and st.get("availableReplicas") == want
        and st.get("replicas") == want
    )


@pytest.fixture(scope="module")
def deployed(cluster: Cluster, operator: Operator, overlay_namespaces: None) -> Iterator[Deployed]:
    """The chart, every tiny example and the production overlay, applied server-side
    and reconciled by the operator: its pipelines Ready, the chart's Deployment out."""
    chart_ns, examples_ns = f"gitops-chart-{os.getpid()}", f"gitops-examples-{os.getpid()}"
    chart = chart_docs(chart_ns)
    [chart_crd] = [d for d in chart if d["metadata"]["name"] == CRD]
    assert chart_crd == yaml.safe_load(LIVE_CRD.read_text()), "the chart's CRD is not crds/'s"
    examples = []
    for path in sorted((REPO / "examples").glob("tiny-*.yaml")):
        doc = yaml.safe_load(path.read_text())
        doc["metadata"]["namespace"] = examples_ns
        examples.append(doc)
    docs = [
        namespace_doc(chart_ns),
        namespace_doc(examples_ns),
        *chart,
        *examples,
        *for_shared_cluster(GITOPS / "overlays" / PRODUCTION.name),
    ]
    # Namespaces and CRDs first, as Flux applies them: kubectl maps every object's kind
    # before it applies any, and the chart's peering is of a kind its CRD brings.
    first = [d for d in docs if d["kind"] in ("Namespace", "CustomResourceDefinition")]
    cluster.kubectl("apply", "--server-side", "-f", "-", input=dump(first))
    for crd in (d for d in first if d["kind"] == "CustomResourceDefinition"):
        cluster.wait_crd_established(crd["metadata"]["name"])
    cluster.kubectl("apply", "--server-side", "-f", "-", input=dump(docs))
    pipelines = [
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for d in docs
        if d["kind"] == "OmniPipeline"
    ]
    assert len(pipelines) == len(examples) + 1
    wait_for(
        "every pipeline reconciled and Ready",
        lambda: all(reconciled(cluster, ns, name) for ns, name in pipelines),
        180,
    )
    [operator_dep] = [d for d in chart if d["kind"] == "Deployment"]
    wait_for(
        "the chart's Deployment rolled out",
        lambda: rolled_out(cluster, chart_ns, operator_dep["metadata"]["name"]),
    )
    yield Deployed(docs, pipelines)
    for d in chart:
        if (
            d["kind"] not in ("Namespace", "CustomResourceDefinition")
            and "namespace" not in d["metadata"]
        ):
            cluster.kubectl("delete", d["kind"], d["metadata"]["name"], "--wait=false", check=False)
    for ns in (chart_ns, examples_ns):
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def live_versions(
    cluster: Cluster, docs: list[Manifest]
) -> dict[tuple[str, str, str], tuple[str, int]]:
    items = json.loads(cluster.kubectl("get", "-f", "-", "-o", "json", input=dump(docs)).stdout)
    return {
        key(i): (i["metadata"]["resourceVersion"], i["metadata"].get("generation", 0))
        for i in items["items"]
    }


def child_generations(cluster: Cluster, pipelines: list[tuple[str, str]]) -> dict[Any, int]:
    return {
        (ns, *k): obj["metadata"]["generation"]
        for ns, name in pipelines
        for k, obj in children(cluster, ns, name).items()
        if "generation" in obj["metadata"]
    }


def drift_reconciles(operator: Operator) -> float:
    url = f"http://127.0.0.1:{operator.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("omnipipe_operator_reconcile_total{") and 'trigger="drift"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_second_apply_changes_nothing_and_diff_is_empty(
    cluster: Cluster, operator: Operator, deployed: Deployed
) -> None:
    text = dump(deployed.docs)
    before = live_versions(cluster, deployed.docs)
    assert set(before) == {key(d) for d in deployed.docs}
    kids = child_generations(cluster, deployed.pipelines)
    proc = cluster.kubectl("apply", "--server-side", "-o", "json", "-f", "-", input=text)
    applied = {
        key(i): (i["metadata"]["resourceVersion"], i["metadata"].get("generation", 0))
        for i in json.loads(proc.stdout)["items"]
    }
    changed = {k: (before[k], v) for k, v in applied.items() if before[k] != v}
    assert changed == {}, "the second apply changed (resourceVersion, generation)"
    diff = cluster.kubectl(
        "diff", "--server-side", f"--field-manager={APPLIER}", "-f", "-", input=text, check=False
    )
    assert (diff.returncode, diff.stdout, diff.stderr) == (0, "", "")
    # The operator's drift check runs on every pipeline after the apply (each one's timer
    # fires once per interval: twice as many checks as the operator has pipelines, other
    # tests' included, covers each), and still nothing the user applied has changed,
    # nor any child's spec.
    start = drift_reconciles(operator)
    everywhere = len(get_json(cluster, "omnip", "-A")["items"])
    wait_for(
        "a drift check of every pipeline",
        lambda: drift_reconciles(operator) >= start + 2 * everywhere,
    )
    assert child_generations(cluster, deployed.pipelines) == kids
    again = cluster.kubectl(
        "diff", "--server-side", f"--field-manager={APPLIER}", "-f", "-", input=text, check=False
    )
    assert (again.returncode, again.stdout) == (0, "")


def owned_paths(fields: Manifest, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every leaf path of a managedFields fieldsV1 set, e.g. ('f:spec', 'f:model')."""
    paths: set[tuple[str, ...]] = set()
    for name, sub in fields.items():
        if name == ".":
            continue
        here = (*prefix, name)
        inner = {k: v for k, v in sub.items() if k != "."}
        paths |= owned_paths(inner, here) if inner else {here}
    return paths


def test_operator_owns_no_field_of_the_users_manifest(cluster: Cluster, deployed: Deployed) -> None:
    manifests = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d
        for d in deployed.docs
        if d["kind"] == "OmniPipeline"
    }
    for (ns, name), manifest in manifests.items():
        live = get_json(cluster, "omnip", name, "-n", ns, "--show-managed-fields")
        entries = live["metadata"]["managedFields"]
        user_labels = set(manifest["metadata"].get("labels", {}))
        user_annotations = set(manifest["metadata"].get("annotations", {}))
        [applier] = [e for e in entries if e["manager"] == APPLIER]
        assert applier["operation"] == "Apply"
        mine = owned_paths(applier["fieldsV1"])
        for field in manifest["spec"]:
            assert any(p[:2] == ("f:spec", f"f:{field}") for p in mine), (name, field)
        for label in user_labels:
            assert ("f:metadata", "f:labels", f"f:{label}") in mine
        for note in user_annotations:
            assert ("f:metadata", "f:annotations", f"f:{note}") in mine
        others = [e for e in entries if e["manager"] != APPLIER]
        assert others, f"{ns}/{name}: the operator has written nothing"
        for entry in others:
            for path in owned_paths(entry["fieldsV1"]):
                where = f"{ns}/{name}: {entry['manager']} owns {'.'.join(path)}"
                if path[0] == "f:status":
                    assert entry.get("subresource") == "status", where
                    continue
                if path == KOPF_FINALIZER:
                    continue
                assert path[:2] == ("f:metadata", "f:annotations"), where
                annotation = path[2].removeprefix("f:")
                assert annotation.startswith(OPERATOR_ANNOTATIONS), where
                assert annotation not in user_annotations, where


# -- what Flux's `wait: true` waits for ----------------------------------------------------


def condition(obj: Manifest, kind: str) -> Manifest:
    found: Manifest = next(
        (c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {}
    )
    return found


def flux_current(obj: Manifest) -> bool:
    """kstatus' Current (sigs.k8s.io/cli-utils itself), which Flux's `wait: true` waits
    for. Reconciling must also be there and False: kstatus reads an object with no
    conditions at all as Current, so an operator that never says would pass unseen."""
    return kstatus(obj)[0] == "Current" and condition(obj, "Reconciling").get("status") == "False"


def test_flux_wait_finds_every_example_current(cluster: Cluster, deployed: Deployed) -> None:
    examples = [(ns, name) for ns, name in deployed.pipelines if ns != PRODUCTION.namespace]
    pending: list[str] = []

    def all_current() -> bool:
        pending[:] = [
            f"{ns}/{name}: {condition(obj, 'Reconciling').get('message')}"
            for ns, name in examples
            if not flux_current(obj := get_json(cluster, "omnip", name, "-n", ns))
        ]
        return not pending

    try:
        wait_for("every example current in kstatus' sense", all_current, 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; Flux would still wait for {pending}") from None


def held_below_minimum(obj: Manifest) -> bool:
    """The autoscaler has decided on a stage and holds it below its minReplicas."""
    minimum = {
        s["name"]: s["autoscaling"]["minReplicas"]
        for s in obj["spec"].get("stages", [])
        if "autoscaling" in s
    }
    return any(
        s["name"] in minimum
        and s.get("lastDecisionReason")
        and s.get("desiredReplicas", 0) < minimum[s["name"]]
        for s in obj.get("status", {}).get("stages", [])
    )


def test_flux_wait_finds_the_autoscaled_production_overlay_current(
    cluster: Cluster, deployed: Deployed
) -> None:
    def settled() -> Manifest | None:
        obj: Manifest = get_json(cluster, "omnip", PIPELINE, "-n", PRODUCTION.namespace)
        return obj if flux_current(obj) or held_below_minimum(obj) else None

    obj = wait_for("production current, or a stage held below its minimum", settled, 60)
    assert flux_current(obj), condition(obj, "Reconciling")
