"""spec.placement on Kubernetes: a colocated group is one Deployment, its stages'
Services select its pods, and status, rollouts and discovery read it per stage."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from omnipipe.api import parse_resource, resolve
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.status import ConditionStatus
from omnipipe.operator.builders import build_children, build_context
from omnipipe.operator.planner import ObservedDeployment, plan_rollout
from omnipipe.operator.settings import OperatorSettings
from omnipipe.operator.status_rollup import compute_status
from omnipipe.router.discovery import DnsDiscovery

GROUPED = {"mode": "colocated", "groups": [{"name": "pixels", "stages": ["denoise", "decode"]}]}
READY = ObservedDeployment(desired=1, replicas=1, ready=1, updated=1, up_to_date=True)


def resource(**spec: Any) -> Any:
    return parse_resource(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image", **spec},
        }
    )


def children(**spec: Any) -> dict[tuple[str, str], Any]:
    ctx = build_context(resource(**spec), OperatorSettings(worker_image="w", router_image="r"))
    return {(m["kind"], m["metadata"]["name"]): m for m in build_children(ctx)}


def deployments(built: dict[tuple[str, str], Any]) -> dict[str, Any]:
    return {name: m for (kind, name), m in built.items() if kind == "Deployment"}


def test_a_group_is_one_deployment_whose_worker_runs_its_stages() -> None:
    built = children(placement=GROUPED)
    rev = pipeline_revision(resolve(resource(placement=GROUPED)))
    assert sorted(deployments(built)) == [f"p-encode-{rev}", f"p-pixels-{rev}", "p-router"]
    worker = deployments(built)[f"p-pixels-{rev}"]["spec"]["template"]["spec"]["containers"][0]
    assert worker["args"][-4:] == ["--group", "pixels", "--transfer-ports", "8101,8102"]
    assert [p["name"] for p in worker["ports"]] == ["control", "transfer", "transfer-1"]


def test_each_stage_of_a_group_is_reached_through_its_own_service() -> None:
    built = children(placement=GROUPED)
    for stage, port in (("denoise", "transfer"), ("decode", "transfer-1")):
        service = built[("Service", f"p-{stage}")]["spec"]
        assert service["selector"] == {"omnipipe.io/pipeline": "p", "omnipipe.io/stage": "pixels"}
        assert service["ports"][1]["targetPort"] == port
    encode = built[("Service", "p-encode")]["spec"]
    assert encode["selector"]["omnipipe.io/stage"] == "encode"


def test_a_disaggregated_pipeline_builds_as_before() -> None:
    assert children() == children(placement={"mode": "disaggregated"})


def template_hashes(**spec: Any) -> dict[str, str]:
    return {
        name.rsplit("-", 1)[0]: m["spec"]["template"]["metadata"]["annotations"][
            "omnipipe.io/config-hash"
        ]
        for name, m in deployments(children(**spec)).items()
        if name != "p-router"
    }


def test_editing_one_stage_of_a_group_rolls_the_group_and_nothing_else() -> None:
    before = template_hashes(placement=GROUPED)
    after = template_hashes(placement=GROUPED, stages=[{"name": "decode", "maxBatch": 2}])
    assert after["p-pixels"] != before["p-pixels"]
    assert after["p-encode"] == before["p-encode"]


def test_the_groups_deployment_makes_each_of_its_stages_ready() -> None:
    pipeline = resolve(resource(placement=GROUPED))
    rev = pipeline_revision(pipeline)
    ready = {f"p-encode-{rev}": READY, f"p-pixels-{rev}": READY, "p-router": READY}
    status = compute_status(pipeline, 1, ready, (), "http://e/v1", "t")
    kinds = {c.type: c.status for c in status.conditions}
    assert kinds["StageDenoiseReady"] is ConditionStatus.TRUE
    assert kinds["StageDecodeReady"] is ConditionStatus.TRUE
    assert kinds["Ready"] is ConditionStatus.TRUE
    down = {**ready, f"p-pixels-{rev}": ObservedDeployment(1, 1, 0, 1, True)}
    kinds = {c.type: c.status for c in compute_status(pipeline, 1, down, (), "e", "t").conditions}
    assert kinds["StageDenoiseReady"] is kinds["StageDecodeReady"] is ConditionStatus.FALSE


def test_a_revision_with_a_group_is_ready_when_its_deployments_are() -> None:
    pipeline = resolve(resource(placement=GROUPED))
    rev = pipeline_revision(pipeline)
    observed = [
        ObservedDeployment(1, 1, 1, 1, True, stage=name, revision=rev)
        for name in ("encode", "pixels")
    ]
    assert plan_rollout(pipeline, None, observed).revision_ready(rev)


@pytest.mark.asyncio
async def test_the_router_calls_a_grouped_stage_under_its_groups_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def resolved(host: str, port: int, **_: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.88.0.7", port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolved)
    discovery = DnsDiscovery(resolve(resource(placement=GROUPED)), "cluster.local")
    assert await discovery.endpoints("decode") == ["http://10.88.0.7:8100/stages/decode"]
    assert await discovery.endpoints("encode") == ["http://10.88.0.7:8100"]


def test_tcp_peers_may_reach_every_transfer_port_of_a_group() -> None:
    built = children(placement=GROUPED, transfer={"backend": "tcp"})
    [policy] = [m for (kind, _), m in built.items() if kind == "NetworkPolicy"]
    [port] = policy["spec"]["ingress"][1]["ports"]
    assert (port["port"], port["endPort"]) == (8101, 8102)
