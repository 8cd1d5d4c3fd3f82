"""What GitOps tools see on live pipelines of the real node: Flux's kstatus (built from
sigs.k8s.io/cli-utils) and Argo CD's health check (charts/omnipipe/health/, run by Argo
CD's Lua runtime). A pipeline that cannot start is Failed/Degraded with its stage's
reason, not InProgress until a timeout; one that starts is InProgress/Progressing, then
Current/Healthy. The serving, scale-up and rollout verdicts are read in test_scaling.py
and test_changes.py, on the pipelines those tests run."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import yaml

from tests.harness.gitops import argo_health, kstatus
from tests.harness.node import RealNode
from tests.realnode.conftest import get_json, gitops_verdicts, wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(600)]


def pipeline(name: str, **spec: Any) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": name},
            "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image", **spec},
        }
    )


def stalled_condition(node: RealNode, namespace: str, name: str) -> dict[str, Any]:
    obj = get_json(node, "omnipipeline", name, "-n", namespace)
    conds = {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}
    found: dict[str, Any] = conds["Stalled"]
    return found


@contextmanager
def versions_after(
    node: RealNode, namespace: str, name: str, since: str
) -> Iterator[list[dict[str, Any]]]:
    """Every version of the pipeline after resourceVersion `since`, in order, as the API
    server's watch sends them while the block runs: each status write, however short it
    stood (a poll can miss one that stood for less than a kubectl call under load)."""
    context = ssl.create_default_context(cafile=str(node.workdir / "ca.crt"))
    context.load_cert_chain(node.workdir / "admin.crt", node.workdir / "admin.key")
    query = urllib.parse.urlencode(
        {
            "watch": "1",
            "resourceVersion": since,
            "fieldSelector": f"metadata.name={name}",
            "timeoutSeconds": "600",  # the server's end of a watch this block forgot
        }
    )
    server = urllib.parse.urlsplit(node.server)
    connection = http.client.HTTPSConnection(server.netloc, context=context, timeout=600)
    connection.request(
        "GET", f"/apis/omnipipe.io/v1alpha1/namespaces/{namespace}/omnipipelines?{query}"
    )
    # Kept to end the watch: closing the response would wait for the reader's blocked read.
    sock = connection.sock
    response = connection.getresponse()
    assert response.status == 200, response.read()
    versions: list[dict[str, Any]] = []

    def read() -> None:
        try:
            for line in response:
                event = json.loads(line)
                if event.get("type") in ("ADDED", "MODIFIED"):
                    versions.append(event["object"])
        except (OSError, ValueError, http.client.HTTPException):
            pass  # the socket shut when the block ends

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield versions
    finally:
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        reader.join(timeout=10)
        connection.close()


def expect_failed(
    node: RealNode, namespace: str, name: str, manifest: str, reason: str, detail: str
) -> None:
    """Apply, then watch both verdicts on every version of the pipeline: InProgress/
    Progressing from the operator's first status write until the pipeline is
    Failed/Degraded with the reason; never Current/Healthy on the way."""
    created = json.loads(
        node.kubectl("apply", "-n", namespace, "-f", "-", "-o", "json", input=manifest).stdout
    )

    def failed(obj: dict[str, Any]) -> bool:
        (flux, _), (argo, argo_msg) = kstatus(obj), argo_health(obj)
        return flux == "Failed" and argo == "Degraded" and reason in argo_msg

    with versions_after(node, namespace, name, created["metadata"]["resourceVersion"]) as seen:
        wait_for(
            f"{name} to be Failed (kstatus) and Degraded (Argo CD)",
            lambda: bool(seen) and failed(seen[-1]),
            300,
        )
        versions = list(seen)
    # kstatus reads a custom resource with no status at all as Current: the versions
    # between the create and the operator's first status write (a finalizer) are not read.
    verdicts = [(kstatus(v)[0], argo_health(v)[0]) for v in versions if "status" in v]
    assert verdicts, versions
    assert all(flux != "Current" and argo != "Healthy" for flux, argo in verdicts), verdicts
    assert verdicts[0][0] == "InProgress", verdicts
    assert verdicts[-1] == ("Failed", "Degraded"), verdicts
    stalled = stalled_condition(node, namespace, name)
    assert stalled["reason"] == reason
    assert detail in stalled["message"], stalled["message"]
    flux_message = kstatus(get_json(node, "omnipipeline", name, "-n", namespace))[1]
    assert detail in flux_message, flux_message


def test_an_image_that_cannot_be_pulled_fails_with_the_stage(
    node: RealNode, operator: str, namespace: str
) -> None:
    manifest = pipeline("nopull", images={"worker": "localhost/omnipipe/missing:dev"})
    expect_failed(
        node, namespace, "nopull", manifest, "ImagePullFailed", "localhost/omnipipe/missing:dev"
    )


def test_a_model_the_worker_cannot_load_fails_as_a_crash_loop(
    node: RealNode, operator: str, namespace: str
) -> None:
    # Not a tiny model, so each stage would ask for its GPU: this node has none.
    cpu_only = [{"name": s, "resources": {"gpus": 0}} for s in ("encode", "denoise", "decode")]
    manifest = pipeline("nomodel", model="/models/missing", stages=cpu_only)
    expect_failed(node, namespace, "nomodel", manifest, "CrashLooping", "/models/missing")


def test_a_stage_no_node_can_take_fails_as_unschedulable(
    node: RealNode, operator: str, namespace: str
) -> None:
    manifest = pipeline("toobig", stages=[{"name": "denoise", "resources": {"cpu": "500"}}])
    expect_failed(node, namespace, "toobig", manifest, "Unschedulable", "Insufficient cpu")
    # The other stages started and serve nothing alone: not Ready, and not Reconciling
    # (kstatus takes the first of the two that is True).
    obj = get_json(node, "omnipipeline", "toobig", "-n", namespace)
    conds = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conds["Reconciling"]["status"] == "False"
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "Unschedulable")
    # Fixing it in Git (here: applying the fix) clears the stall.
    node.kubectl("apply", "-n", namespace, "-f", "-", input=pipeline("toobig"))
    wait_for(
        "the fixed pipeline to be Current and Healthy",
        lambda: gitops_verdicts(node, namespace, "toobig") == ("Current", "Healthy"),
        300,
    )
