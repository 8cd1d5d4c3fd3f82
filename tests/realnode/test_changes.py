"""Changes on real pods: a new revision rolls out under a steady stream of requests with
none failing and each running on one revision; a worker pod deleted mid-request gives
the client a clean OpenAI-shaped error, and the next request succeeds."""

from __future__ import annotations

import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
import yaml

from tests.harness.node import RealNode
from tests.realnode.conftest import (
    apply_and_wait_ready,
    get_json,
    gitops_verdicts,
    pods,
    router_url,
    verdict_watch,
    wait_for,
)

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(900)]
REQUEST_LINE = re.compile(r"omnipipe\.worker\.requests: request (\S+) stage (\w+) revision (\w+)")


def manifest(name: str, backend: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": name},
            "spec": {
                "model": "tiny://qwen-image",
                "pipeline": "qwen-image",
                "transfer": {"backend": backend},
            },
        }
    )


@contextmanager
def stage_logs(node: RealNode, namespace: str, name: str) -> Iterator[list[str]]:
    """Every line each stage pod of the pipeline logs while the block runs, pods that
    appear later included (`kubectl logs -f` on each as it is seen)."""
    lines: list[str] = []
    followers: dict[str, subprocess.Popen[str]] = {}
    readers: list[threading.Thread] = []
    stop = threading.Event()

    def read(proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    def watch() -> None:
        while not stop.is_set():
            for p in pods(node, namespace, f"omnipipe.io/pipeline={name},omnipipe.io/stage"):
                pod = p["metadata"]["name"]
                running = p["status"].get("containerStatuses", [{}])[0].get("state", {})
                if pod in followers or "running" not in running:
                    continue
                followers[pod] = subprocess.Popen(
                    [str(node.bin_dir / "kubectl"), "logs", "-f", "-n", namespace, pod],
                    env=node.env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
                reader = threading.Thread(target=read, args=(followers[pod],), daemon=True)
                reader.start()
                readers.append(reader)
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield lines
    finally:
        stop.set()
        watcher.join(timeout=30)
        # And the whole log of each pod still there: a follower that exited at its start
        # (the log not there yet, under load) read nothing. A line read twice counts once.
        for p in pods(node, namespace, f"omnipipe.io/pipeline={name},omnipipe.io/stage"):
            pod = p["metadata"]["name"]
            whole = node.kubectl("logs", "-n", namespace, pod, check=False).stdout
            lines.extend(whole.splitlines(keepends=True))
        for proc in followers.values():
            proc.terminate()
            proc.wait(timeout=10)
        for reader in readers:
            reader.join(timeout=10)
        for proc in followers.values():
            assert proc.stdout is not None
            proc.stdout.close()


@contextmanager
def steady_stream(url: str, model: str) -> Iterator[tuple[list[str], list[BaseException]]]:
    """Two clients sending requests back to back; (one entry per answer, the failures)."""
    stop = threading.Event()
    answered: list[str] = []
    failures: list[BaseException] = []

    def run() -> None:
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
            while not stop.is_set():
                try:
                    r = c.images.with_raw_response.generate(
                        model=model,
                        prompt="a lighthouse",
                        size="64x64",
                        extra_body={"num_inference_steps": 2},
                    )
                    assert r.parse().data[0].b64_json
                    answered.append(r.http_request.url.path)
                except Exception as exc:
                    failures.append(exc)
                time.sleep(0.05)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        yield answered, failures
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=130)


def status(node: RealNode, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = get_json(node, "omnipipeline", name, "-n", namespace).get("status", {})
    return found


def test_a_new_revision_rolls_out_under_steady_requests(
    node: RealNode, operator: str, namespace: str
) -> None:
    name = "rolling"
    apply_and_wait_ready(node, namespace, manifest(name, "ucx"), name)
    old = status(node, namespace, name)["currentRevision"]
    url = router_url(node, namespace, name)
    with (
        stage_logs(node, namespace, name) as lines,
        steady_stream(url, name) as (ok, failed),
        verdict_watch(node, namespace, name) as readings,
    ):
        wait_for("requests on the first revision", lambda: len(ok) >= 5, 60)
        # What stages hand each other changes: old and new stages cannot be mixed, so
        # this is a new revision, rolled out beside the old one as a model change is.
        node.kubectl("apply", "-n", namespace, "-f", "-", input=manifest(name, "tcp"))
        new = wait_for(
            "a new current revision",
            lambda: (r := status(node, namespace, name).get("currentRevision")) != old and r,
            600,
        )
        wait_for(
            "the old revision's pods to be gone",
            lambda: (
                not pods(node, namespace, f"omnipipe.io/pipeline={name},omnipipe.io/revision={old}")
            ),
            300,
        )
        served_before = len(ok)
        wait_for("requests on the new revision", lambda: len(ok) >= served_before + 5, 60)
    assert failed == [], failed[:3]
    revisions: dict[str, set[str]] = {}
    for line in lines:
        if m := REQUEST_LINE.search(line):
            request, _stage, revision = m.groups()
            revisions.setdefault(request, set()).add(revision)
    mixed = {r: revs for r, revs in revisions.items() if len(revs) > 1}
    assert mixed == {}, f"requests that ran on two revisions: {mixed}"
    ran_on = {next(iter(revs)) for revs in revisions.values()}
    assert ran_on == {old, new}, ran_on
    assert condition_true(node, namespace, name)
    # Flux and Argo CD saw the rollout as one: InProgress/Progressing, never Failed.
    verdicts = [(r.flux, r.argo) for r in readings]
    assert ("InProgress", "Progressing") in verdicts, verdicts
    assert not {"Failed", "Degraded"} & {v for pair in verdicts for v in pair}, verdicts
    wait_for(
        "Current and Healthy once rolled out",
        lambda: gitops_verdicts(node, namespace, name) == ("Current", "Healthy"),
        60,
    )


def condition_true(node: RealNode, namespace: str, name: str) -> bool:
    conds = {c["type"]: c["status"] for c in status(node, namespace, name)["conditions"]}
    return conds.get("Ready") == "True"


def running(pod: dict[str, Any]) -> float:
    url = f"http://{pod['status']['podIP']}:8100/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("omnipipe_stage_requests_running{")
    )


def test_a_worker_killed_mid_request_gives_a_clean_error_then_recovers(
    node: RealNode, operator: str, namespace: str
) -> None:
    name = "killed"
    apply_and_wait_ready(node, namespace, manifest(name, "ucx"), name)
    (denoise,) = pods(node, namespace, f"omnipipe.io/pipeline={name},omnipipe.io/stage=denoise")
    url = router_url(node, namespace, name)
    outcome: list[BaseException | str] = []

    def slow_request() -> None:
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as c:
            try:
                c.images.generate(
                    model=name,
                    prompt="a lighthouse",
                    size="1024x1024",
                    extra_body={"num_inference_steps": 30},
                )
                outcome.append("answered")
            except Exception as exc:
                outcome.append(exc)

    client = threading.Thread(target=slow_request, daemon=True)
    client.start()
    wait_for(
        "denoise to be working on the request",
        lambda: running(denoise) > 0 or outcome,
        120,
    )
    assert not outcome, f"the request ended before its worker was killed: {outcome}"
    started = time.monotonic()
    # kubectl delete pod, with a grace period shorter than the request: the worker is
    # killed mid-request (a longer one would drain it, which another test covers).
    node.kubectl(
        "delete",
        "pod",
        "-n",
        namespace,
        denoise["metadata"]["name"],
        "--grace-period=1",
        "--wait=false",
    )
    client.join(timeout=120)
    assert not client.is_alive(), "the client hung after its worker died"
    (result,) = outcome
    assert isinstance(result, openai.APIStatusError), result
    assert result.status_code in (502, 503, 504), result
    body = result.body
    assert isinstance(body, dict), body
    assert body.get("message"), body
    assert time.monotonic() - started < 60
    # Recovery: the Deployment's new pod serves the next request.
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as c:

        def answered() -> bool:
            try:
                return bool(
                    c.images.generate(
                        model=name,
                        prompt="a lighthouse",
                        size="64x64",
                        extra_body={"num_inference_steps": 2},
                    )
                    .data[0]
                    .b64_json
                )
            except openai.APIStatusError as exc:
                # No ready denoise replica yet: a 503, and nothing else.
                if exc.status_code != 503:
                    raise
                return False

        wait_for("a request to succeed after the restart", answered, 300)


def test_an_adapter_added_to_the_resource_loads_into_the_running_worker(
    node: RealNode, operator: str, namespace: str
) -> None:
    """kubectl apply of the resource with a LoRA adapter: no pod restarts; the kubelet
    updates the mounted pipeline file, the denoise worker loads the adapter and the
    router lists and serves it; applied without it, both drop it."""
    name = "styled"
    plain = manifest(name, "ucx")
    apply_and_wait_ready(node, namespace, plain, name)
    selector = f"omnipipe.io/pipeline={name},omnipipe.io/stage"
    before = {p["metadata"]["uid"] for p in pods(node, namespace, selector)}
    url = router_url(node, namespace, name)
    styled = yaml.safe_load(plain)
    styled["spec"]["adapters"] = [
        {"name": "ink", "source": "tiny://qwen-image-lora", "stage": "denoise"}
    ]
    node.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(styled))
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:

        def served_by(model: str) -> bool:
            try:
                c.images.generate(
                    model=model,
                    prompt="a lighthouse",
                    size="64x64",
                    extra_body={"num_inference_steps": 2, "seed": 1},
                )
                return True
            except (openai.NotFoundError, openai.BadRequestError):
                # The router has not seen the adapter yet (404), or the worker has not
                # loaded it yet (400 naming lora.name).
                return False

        wait_for("the adapter to be listed", lambda: "ink" in {m.id for m in c.models.list()})
        wait_for("the adapter to serve an image", lambda: served_by("ink"))
        node.kubectl("apply", "-n", namespace, "-f", "-", input=plain)
        wait_for("the adapter to go", lambda: "ink" not in {m.id for m in c.models.list()})
        with pytest.raises(openai.NotFoundError):
            c.images.generate(model="ink", prompt="a lighthouse", size="64x64")
        assert served_by(name)
    after = pods(node, namespace, selector)
    assert {p["metadata"]["uid"] for p in after} == before
    assert all(p["status"]["containerStatuses"][0]["restartCount"] == 0 for p in after)
