"""weights.source cache on a real volume: a StorageClass whose provisioner makes the
claim a folder on the node's disk (Rancher's local-path-provisioner, kind's default), the
operator's fetch Job running once on the real node to fill it, every stage pod (the two
denoise replicas too) mounting it read-only, an image served from it, and the volume's
folder gone once the pipeline is deleted."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from tests.harness import local_path
from tests.harness.node import RealNode
from tests.realnode.conftest import apply_and_wait_ready, get_json, pods, router_url, wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(900)]
NAME = "cached-image"
PIPELINE = f"""apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {{name: {NAME}}}
spec:
  model: tiny://qwen-image
  pipeline: qwen-image
  weights: {{source: cache, size: 1Gi, storageClassName: {local_path.STORAGE_CLASS}}}
  stages:
    - {{name: denoise, replicas: 2}}
"""


@pytest.fixture(scope="module")
def volumes(node: RealNode, images: dict[str, str]) -> Path:
    """The provisioner, running; the node's folder its volumes go under."""
    root = node.workdir / "local-path"
    root.mkdir(exist_ok=True)
    node.import_image(local_path.LAYOUT, local_path.IMAGE)
    node.kubectl("apply", "-f", "-", input=local_path.manifest(root, images["worker"]))
    node.kubectl(
        "rollout",
        "status",
        "-n",
        local_path.NAMESPACE,
        "deployment/local-path-provisioner",
        "--timeout=120s",
        timeout=150,
    )
    return root


def volume_of(node: RealNode, namespace: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pipeline's one claim and the volume bound to it."""
    [claim] = get_json(node, "persistentvolumeclaims", "-n", namespace)["items"]
    assert claim["status"]["phase"] == "Bound", claim["status"]
    return claim, get_json(node, "persistentvolume", claim["spec"]["volumeName"])


def test_cached_weights_are_fetched_once_into_a_provisioned_volume_every_replica_mounts(
    node: RealNode, operator: str, namespace: str, volumes: Path
) -> None:
    took = apply_and_wait_ready(node, namespace, PIPELINE, NAME)
    print(f"[realnode] {NAME}: apply to Ready, fetch included, {took:.1f} s", file=sys.stderr)
    [job] = get_json(node, "jobs", "-n", namespace)["items"]
    assert job["status"].get("succeeded") == 1, job["status"]
    [fetch] = pods(node, namespace, f"job-name={job['metadata']['name']}")
    [node_name] = [n["metadata"]["name"] for n in get_json(node, "nodes")["items"]]
    assert fetch["spec"]["nodeName"] == node_name
    assert fetch["status"]["phase"] == "Succeeded"

    claim, volume = volume_of(node, namespace)
    assert claim["spec"]["storageClassName"] == local_path.STORAGE_CLASS
    annotations = volume["metadata"]["annotations"]
    assert annotations["pv.kubernetes.io/provisioned-by"] == local_path.PROVISIONER
    folder = Path(volume["spec"]["hostPath"]["path"])
    assert folder.parent == volumes
    # The fetch renamed a whole checkpoint into place: the files are on the node's disk.
    assert (folder / "model" / "model_index.json").is_file()
    assert (folder / "model" / "transformer").is_dir()

    stage_pods = pods(node, namespace, f"omnipipe.io/pipeline={NAME},omnipipe.io/stage")
    stages = sorted(p["metadata"]["labels"]["omnipipe.io/stage"] for p in stage_pods)
    assert stages == ["decode", "denoise", "denoise", "encode"]
    for p in stage_pods:
        claims = [
            v["persistentVolumeClaim"] for v in p["spec"]["volumes"] if "persistentVolumeClaim" in v
        ]
        assert claims == [{"claimName": claim["metadata"]["name"], "readOnly": True}]
        assert all(s["ready"] for s in p["status"]["containerStatuses"])

    with openai.OpenAI(
        base_url=router_url(node, namespace, NAME), api_key="unused", max_retries=0, timeout=300
    ) as client:
        r = client.images.generate(
            model=NAME, prompt="a lighthouse at dusk", size="64x64", n=2,
            extra_body={"num_inference_steps": 2},
        )  # fmt: skip
    made = [Image.open(io.BytesIO(base64.b64decode(d.b64_json or ""))) for d in r.data or []]
    assert [i.size for i in made] == [(64, 64)] * 2
    assert np.asarray(made[0]).std() > 0, "a flat image: the stages did not run"

    # Deleted with the pipeline: the claim, then (reclaim policy Delete) the volume, whose
    # teardown helper removes the folder.
    node.kubectl("delete", "omnipipeline", NAME, "-n", namespace, "--wait=true", timeout=180)
    wait_for(
        "the claim and its volume to go",
        lambda: (
            not get_json(node, "persistentvolumeclaims", "-n", namespace)["items"]
            and volume["metadata"]["name"]
            not in {v["metadata"]["name"] for v in get_json(node, "persistentvolumes")["items"]}
        ),
        180,
    )
    wait_for("the volume's folder to go", lambda: not folder.exists(), 120)
