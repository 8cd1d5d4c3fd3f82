from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omnipipe.api import load_file, parse_resource
from omnipipe.api.yamlio import dump_all
from omnipipe.operator.builders import build_children, build_context, build_credential_secret
from omnipipe.operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SETTINGS = OperatorSettings(
    worker_image="omnipipe/worker:test",
    router_image="omnipipe/router:test",
    # Read by video pipelines' routers only: the other goldens show it nowhere.
    video_store="redis://redis.omnipipe-system:6379/0",
)
CREDENTIAL_ENV_FROM_SECRET = {
    "name": "OMNIPIPE_PIPELINE_CREDENTIAL",
    "valueFrom": {"secretKeyRef": {"name": "p-credential", "key": "credential"}},
}


def children(
    resource_body: dict[str, Any], uid: str | None = "uid-1"
) -> dict[tuple[str, str], Any]:
    body = {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p", "namespace": "ns", **({"uid": uid} if uid else {})},
        "spec": resource_body,
    }
    ctx = build_context(parse_resource(body), SETTINGS)
    return {(m["kind"], _unversioned(m["metadata"]["name"])): m for m in build_children(ctx)}


def _unversioned(name: str) -> str:
    """A revision's Deployment or ConfigMap by the name it has without its revision
    suffix (p-denoise-<revision> -> p-denoise); the golden files show the real names."""
    head, _, tail = name.rpartition("-")
    return head if len(tail) == 10 and all(ch in "0123456789abcdef" for ch in tail) else name


def revision_of(spec: dict[str, Any]) -> str:
    return str(next(iter(children(spec).values()))["metadata"]["labels"]["omnipipe.io/revision"])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_golden(example: Path, request: pytest.FixtureRequest) -> None:
    resource = load_file(example)
    resource = resource.model_copy(
        update={
            "metadata": resource.metadata.model_copy(
                update={"uid": "00000000-0000-0000-0000-000000000001", "generation": 1}
            )
        }
    )
    rendered = dump_all(build_children(build_context(resource, SETTINGS)))
    golden = GOLDEN / f"{example.stem}.yaml"
    if request.config.getoption("--update-golden"):
        golden.write_text(rendered)
    assert golden.exists(), f"no golden file: run pytest --update-golden and review {golden}"
    assert rendered == golden.read_text(), (
        f"builders changed {golden.name}: review, then --update-golden"
    )


def test_every_child_is_labelled_and_owned() -> None:
    for (kind, name), m in children({"model": "m", "pipeline": "qwen-image"}).items():
        labels = m["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "omnipipe-operator", (kind, name)
        assert labels["omnipipe.io/pipeline"] == "p"
        [owner] = m["metadata"]["ownerReferences"]
        assert owner["uid"] == "uid-1"
        assert owner["controller"] is True
    assert (
        "ownerReferences"
        not in children({"model": "m", "pipeline": "qwen-image"}, uid=None)[
            ("ConfigMap", "p-config")
        ]["metadata"]
    )


def test_pod_hardening_and_probes() -> None:
    dep = children({"model": "m", "pipeline": "qwen2.5-omni"})[("Deployment", "p-thinker")]
    pod = dep["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # vLLM writes caches at run time; transformers stages get a read-only root.
    assert c["securityContext"]["readOnlyRootFilesystem"] is False
    talker = children({"model": "m", "pipeline": "qwen2.5-omni"})[("Deployment", "p-talker")]
    assert (
        talker["spec"]["template"]["spec"]["containers"][0]["securityContext"][
            "readOnlyRootFilesystem"
        ]
        is True
    )
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "control"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "control"}
    # preStop POSTs /drain with the pipeline credential (tests/unit/test_router_worker_auth.py
    # runs the script).
    assert c["lifecycle"]["preStop"]["exec"]["command"][:2] == ["python3", "-c"]
    assert "/drain', method='POST'" in c["lifecycle"]["preStop"]["exec"]["command"][2]
    assert pod["terminationGracePeriodSeconds"] == SETTINGS.termination_grace_seconds


def test_args_are_lists_so_no_field_reaches_a_shell() -> None:
    hostile = "x; rm -rf / #"
    deps = children(
        {
            "model": hostile,
            "pipeline": "qwen-image",
            "stages": [{"name": "denoise", "engineArgs": {"a": "$(reboot)"}}],
        }
    )
    for (kind, _), m in deps.items():
        if kind != "Deployment":
            continue
        [c] = m["spec"]["template"]["spec"]["containers"]
        assert c["command"] == ["omnipipe"]
        assert all(isinstance(a, str) for a in c["args"])
        assert hostile not in " ".join(c["args"])
        assert "sh" not in c["command"]


def test_autoscaled_stage_leaves_replicas_to_the_autoscaler() -> None:
    deps = children(
        {
            "model": "m",
            "pipeline": "qwen-image",
            "stages": [
                {"name": "denoise", "autoscaling": {"maxReplicas": 4}},
                {"name": "encode", "replicas": 2},
            ],
        }
    )
    assert "replicas" not in deps[("Deployment", "p-denoise")]["spec"]
    assert deps[("Deployment", "p-encode")]["spec"]["replicas"] == 2


def test_editing_one_stage_changes_only_its_pod_template() -> None:
    spec: dict[str, Any] = {"model": "m", "pipeline": "qwen-image"}
    before = children(spec)
    after = children({**spec, "stages": [{"name": "denoise", "resources": {"cpu": "2"}}]})
    changed = {k for k in before if k[0] == "Deployment" and before[k] != after[k]}
    assert changed == {("Deployment", "p-denoise")}
    assert revision_of(spec) == revision_of(
        {**spec, "stages": [{"name": "denoise", "resources": {"cpu": "2"}}]}
    )


def test_an_adapter_change_rolls_no_pod_and_reaches_them_through_the_config_map() -> None:
    spec: dict[str, Any] = {"model": "m", "pipeline": "qwen-image"}
    before = children(spec)
    adapter = {"name": "ink", "source": "org/ink-lora", "stage": "denoise"}
    after = children({**spec, "adapters": [adapter]})
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {("ConfigMap", "p-config")}
    assert "org/ink-lora" in json.dumps(after[("ConfigMap", "p-config")]["data"])


def test_turning_tracing_on_rolls_every_pod_in_place() -> None:
    """Every process makes its tracer at its start: the router's and every stage's pod
    template change, the revision does not (no tensor changes)."""
    spec: dict[str, Any] = {"model": "m", "pipeline": "qwen-image"}
    traced = {**spec, "tracing": {"endpoint": "http://collector:4318"}}
    before, after = children(spec), children(traced)
    changed = {k for k in before if k[0] == "Deployment" and before[k] != after[k]}
    assert changed == {k for k in before if k[0] == "Deployment"}
    assert revision_of(spec) == revision_of(traced)


@pytest.mark.parametrize(
    "edit",
    [
        {"model": "m2"},
        {"stages": [{"name": "denoise", "engineArgs": {"steps": 8}}]},
        {"stages": [{"name": "denoise", "engine": "transformers"}]},
        {"transfer": {"backend": "tcp"}},
    ],
    ids=["model", "engine-args", "engine", "transfer"],
)
def test_a_compatibility_change_is_a_new_revision_of_every_stage(edit: dict[str, Any]) -> None:
    spec: dict[str, Any] = {"model": "m", "pipeline": "qwen-image"}
    old, new = revision_of(spec), revision_of({**spec, **edit})
    assert old != new
    after = build_children(
        build_context(
            parse_resource(
                {
                    "apiVersion": "omnipipe.io/v1alpha1",
                    "kind": "OmniPipeline",
                    "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
                    "spec": {**spec, **edit},
                }
            ),
            SETTINGS,
        )
    )
    names = {(m["kind"], m["metadata"]["name"]) for m in after}
    for stage in ("encode", "denoise", "decode"):
        assert ("Deployment", f"p-{stage}-{new}") in names
        # The headless Service spans revisions: the router tells them apart.
        assert ("Service", f"p-{stage}") in names
    assert ("ConfigMap", f"p-config-{new}") in names
    for m in after:
        if m["kind"] == "Deployment" and m["metadata"]["name"] != "p-router":
            template = m["spec"]["template"]["metadata"]["labels"]
            assert template["omnipipe.io/revision"] == new
            assert m["spec"]["selector"]["matchLabels"]["omnipipe.io/revision"] == new


@pytest.mark.parametrize(
    "edit",
    [
        {"stages": [{"name": "denoise", "replicas": 3}]},
        {"stages": [{"name": "denoise", "autoscaling": {"maxReplicas": 9}}]},
        {"stages": [{"name": "encode", "sampling": {"temperature": 0.5}}]},
        {"stages": [{"name": "decode", "resources": {"memory": "2Gi"}}]},
        {"stages": [{"name": "decode", "env": [{"name": "X", "value": "1"}]}]},
        {"router": {"replicas": 2}},
    ],
    ids=["replicas", "autoscaling", "sampling", "resources", "env", "router"],
)
def test_an_in_place_change_keeps_the_revision(edit: dict[str, Any]) -> None:
    spec: dict[str, Any] = {"model": "m", "pipeline": "qwen-image"}
    assert revision_of(spec) == revision_of({**spec, **edit})


def test_router_api_key_comes_from_the_secret_and_service_type_applies() -> None:
    deps = children(
        {
            "model": "m",
            "pipeline": "qwen-image",
            "router": {"serviceType": "LoadBalancer", "apiKeySecretRef": {"name": "keys"}},
        }
    )
    [c] = deps[("Deployment", "p-router")]["spec"]["template"]["spec"]["containers"]
    assert c["env"] == [
        CREDENTIAL_ENV_FROM_SECRET,
        {
            "name": "OMNIPIPE_ROUTER_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-key"}},
        },
    ]
    assert deps[("Service", "p-router")]["spec"]["type"] == "LoadBalancer"
    assert deps[("Service", "p-denoise")]["spec"]["clusterIP"] == "None"


def test_the_admin_key_comes_from_its_own_secret_and_rolls_only_the_router() -> None:
    spec: dict[str, Any] = {"model": "m", "pipeline": "qwen-image"}
    keyed = {**spec, "router": {"adminKeySecretRef": {"name": "ops", "key": "admin"}}}
    plain, deps = children(spec), children(keyed)
    [c] = deps[("Deployment", "p-router")]["spec"]["template"]["spec"]["containers"]
    assert c["env"] == [
        CREDENTIAL_ENV_FROM_SECRET,
        {
            "name": "OMNIPIPE_ROUTER_ADMIN_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "ops", "key": "admin"}},
        },
    ]

    def template(children: Any, name: str) -> Any:
        return children[("Deployment", name)]["spec"]["template"]

    assert template(deps, "p-router") != template(plain, "p-router")
    for stage in ("p-encode", "p-denoise", "p-decode"):
        assert template(deps, stage) == template(plain, stage)


def test_keda_mode_emits_a_scaled_object_with_the_same_policy() -> None:
    deps = children(
        {
            "model": "m",
            "pipeline": "qwen-image",
            "prometheusUrl": "http://prom:9090",
            "stages": [
                {
                    "name": "denoise",
                    "autoscaling": {
                        "mode": "keda",
                        "minReplicas": 0,
                        "maxReplicas": 6,
                        "target": 2,
                        "maxStep": 3,
                        "scaleDownStabilizationSeconds": 120,
                    },
                }
            ],
        }
    )
    so = deps[("ScaledObject", "p-denoise")]
    spec = so["spec"]
    revision = revision_of({"model": "m", "pipeline": "qwen-image"})
    assert spec["scaleTargetRef"]["name"] == f"p-denoise-{revision}"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 6)
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["serverAddress"] == "http://prom:9090"
    assert trigger["metadata"]["threshold"] == "2"
    assert 'stage="denoise"' in trigger["metadata"]["query"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 120
    assert behavior["scaleUp"]["policies"][0]["value"] == 3
    assert "replicas" not in deps[("Deployment", "p-denoise")]["spec"]


def test_hpa_mode_emits_an_external_metric_hpa() -> None:
    deps = children(
        {
            "model": "m",
            "pipeline": "qwen-image",
            "stages": [
                {
                    "name": "denoise",
                    "autoscaling": {
                        "mode": "hpa",
                        "minReplicas": 0,
                        "maxReplicas": 4,
                        "metric": "queue-wait-p90",
                        "target": 0.5,
                    },
                }
            ],
        }
    )
    hpa = deps[("HorizontalPodAutoscaler", "p-denoise")]["spec"]
    assert hpa["minReplicas"] == 1  # HPA cannot reach zero without a feature gate
    [metric] = hpa["metrics"]
    assert metric["external"]["metric"]["selector"]["matchLabels"] == {
        "namespace": "ns",
        "pipeline": "p",
        "stage": "denoise",
        "signal": "queue-wait-p90",
    }
    assert metric["external"]["target"] == {"type": "Value", "value": "0.5"}
    assert ("ScaledObject", "p-denoise") not in deps


# ---- the pipeline credential and the stage pods' NetworkPolicy ------------------------


def test_credential_secret_golden(request: pytest.FixtureRequest) -> None:
    resource = load_file(REPO / "examples/qwen-image.yaml")
    resource = resource.model_copy(
        update={
            "metadata": resource.metadata.model_copy(
                update={"uid": "00000000-0000-0000-0000-000000000001", "generation": 1}
            )
        }
    )
    ctx = build_context(resource, SETTINGS)
    rendered = dump_all([build_credential_secret(ctx, "generated-once-by-the-operator")])
    golden = GOLDEN / "credential-secret.yaml"
    if request.config.getoption("--update-golden"):
        golden.write_text(rendered)
    assert rendered == golden.read_text(), "builders changed credential-secret.yaml"


def test_credential_secret_is_named_and_owned_like_every_child() -> None:
    body = {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p", "namespace": "ns", "uid": "uid-1"},
        "spec": {"model": "m", "pipeline": "qwen-image"},
    }
    secret = build_credential_secret(build_context(parse_resource(body), SETTINGS), "v")
    assert secret["metadata"]["name"] == "p-credential"
    assert secret["metadata"]["labels"]["omnipipe.io/pipeline"] == "p"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert secret["stringData"] == {"credential": "v"}


@pytest.mark.parametrize("pipeline", ["qwen-image", "qwen2.5-omni"])
def test_every_pod_reads_the_credential_from_the_pipeline_secret(pipeline: str) -> None:
    deployments = [
        m
        for m in children({"model": "m", "pipeline": pipeline}).values()
        if m["kind"] == "Deployment"
    ]
    assert len(deployments) >= 4
    for dep in deployments:
        [c] = dep["spec"]["template"]["spec"]["containers"]
        assert CREDENTIAL_ENV_FROM_SECRET in c["env"], dep["metadata"]["name"]
        # Never a literal value: only the Secret holds it.
        assert all(
            e.get("value") is None for e in c["env"] if e["name"] == "OMNIPIPE_PIPELINE_CREDENTIAL"
        )


def _policy(spec: dict[str, Any], settings: OperatorSettings = SETTINGS) -> dict[str, Any]:
    body = {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p", "namespace": "ns", "uid": "uid-1"},
        "spec": spec,
    }
    built = build_children(build_context(parse_resource(body), settings))
    [policy] = [m for m in built if m["kind"] == "NetworkPolicy"]
    return policy


def test_stage_network_policy_admits_router_stages_and_scrapers_only() -> None:
    policy = _policy({"model": "m", "pipeline": "qwen-image", "transfer": {"backend": "tcp"}})
    assert policy["metadata"]["name"] == "p-stages"
    spec = policy["spec"]
    stages = {"omnipipe.io/pipeline": "p", "app.kubernetes.io/component": "stage"}
    assert spec["podSelector"] == {"matchLabels": stages}
    assert spec["policyTypes"] == ["Ingress"]
    router_rule, stage_rule, scrape_rule = spec["ingress"]
    assert router_rule == {
        "from": [
            {
                "podSelector": {
                    "matchLabels": {
                        "omnipipe.io/pipeline": "p",
                        "app.kubernetes.io/component": "router",
                    }
                }
            }
        ],
        "ports": [{"protocol": "TCP", "port": 8100}],
    }
    assert stage_rule == {
        "from": [{"podSelector": {"matchLabels": stages}}],
        "ports": [{"protocol": "TCP", "port": 8101}],
    }
    assert scrape_rule == {
        "from": SETTINGS.metrics_scrape_from,
        "ports": [{"protocol": "TCP", "port": 8100}],
    }


def test_ucx_stage_peers_may_use_the_ports_ucx_picks() -> None:
    policy = _policy({"model": "m", "pipeline": "qwen-image", "transfer": {"backend": "ucx"}})
    stage_rule = policy["spec"]["ingress"][1]
    assert "ports" not in stage_rule
    assert stage_rule["from"] == [
        {
            "podSelector": {
                "matchLabels": {"omnipipe.io/pipeline": "p", "app.kubernetes.io/component": "stage"}
            }
        }
    ]


def test_stage_network_policy_toggles() -> None:
    no_scrape = SETTINGS.model_copy(update={"metrics_scrape_from": []})
    policy = _policy({"model": "m", "pipeline": "qwen-image"}, no_scrape)
    assert len(policy["spec"]["ingress"]) == 2
    off = SETTINGS.model_copy(update={"stage_network_policy": False})
    body = {
        "apiVersion": "omnipipe.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"model": "m", "pipeline": "qwen-image"},
    }
    built = build_children(build_context(parse_resource(body), off))
    assert not [m for m in built if m["kind"] == "NetworkPolicy"]


def test_operator_settings_read_the_chart_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    scrapers = [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]
    monkeypatch.setenv("OMNIPIPE_OPERATOR_STAGE_NETWORK_POLICY", "false")
    monkeypatch.setenv("OMNIPIPE_OPERATOR_METRICS_SCRAPE_FROM", json.dumps(scrapers))
    settings = OperatorSettings()
    assert settings.stage_network_policy is False
    assert settings.metrics_scrape_from == scrapers


def test_a_video_pipelines_store_secret_wins_over_the_operators_store() -> None:
    """spec.videos.storeSecretRef reaches the router as a secretKeyRef (a password stays
    out of the pod spec), in place of the operator's plain URL; the stages do not change."""
    spec: dict[str, Any] = {"model": "tiny://wan", "pipeline": "wan"}
    keyed = {**spec, "videos": {"storeSecretRef": {"name": "redis"}}}
    plain, deps = children(spec), children(keyed)

    def router_env(children: Any) -> list[dict[str, Any]]:
        [c] = children[("Deployment", "p-router")]["spec"]["template"]["spec"]["containers"]
        return [e for e in c["env"] if e["name"] == "OMNIPIPE_ROUTER_VIDEO_STORE"]

    assert router_env(plain) == [
        {"name": "OMNIPIPE_ROUTER_VIDEO_STORE", "value": SETTINGS.video_store}
    ]
    assert router_env(deps) == [
        {
            "name": "OMNIPIPE_ROUTER_VIDEO_STORE",
            "valueFrom": {"secretKeyRef": {"name": "redis", "key": "url"}},
        }
    ]
    for stage in ("p-encode", "p-denoise", "p-decode"):
        assert deps[("Deployment", stage)]["spec"] == plain[("Deployment", stage)]["spec"]
