"""The control plane between router and workers is authenticated: a worker refuses
control calls without the pipeline's credential, drain is a POST, and the stage pods'
preStop hook sends it. (The router's side, sending it on every call, is tested against a
fake worker in test_router_results.py.)"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from omnipipe.api import constants as c
from omnipipe.api import load_file, resolve
from omnipipe.operator.builders.stage import DRAIN_SCRIPT
from omnipipe.worker.server import build_app
from omnipipe.worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[2]
IMAGE = resolve(load_file(REPO / "examples/tiny-text-to-image.yaml"))
CREDENTIAL = "s3cret-pipeline-credential"
SUBMIT = {"request_id": "r1", "params": {}}
# (method, path, body): every control route that changes what the stage does.
CONTROL_CALLS = [
    ("POST", "/v1/requests", SUBMIT),
    ("POST", "/v1/requests/r1/cancel", None),
    ("POST", "/drain", None),
]


def worker(credential: str | None) -> TestClient:
    # No lifespan: no model is loaded, so a submit that gets through is a 503, not a 401.
    settings = WorkerSettings(stage="encode", credential=credential, drain_timeout_seconds=1)
    return TestClient(build_app(IMAGE, settings))


def call(client: TestClient, method: str, path: str, body: Any, **headers: str) -> Any:
    return client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize(("method", "path", "body"), CONTROL_CALLS)
def test_control_calls_without_the_credential_are_401(method: str, path: str, body: Any) -> None:
    client = worker(CREDENTIAL)
    for headers in ({}, {c.CREDENTIAL_HEADER: "wrong"}, {c.CREDENTIAL_HEADER: ""}):
        resp = call(client, method, path, body, **headers)
        assert resp.status_code == 401, (path, headers)
        assert c.CREDENTIAL_HEADER in resp.json()["detail"]
    # A made-up path is refused the same way: nothing is learned without the credential.
    assert call(client, "GET", "/v1/anything", None).status_code == 401


@pytest.mark.parametrize(("method", "path", "body"), CONTROL_CALLS)
def test_control_calls_with_the_credential_are_accepted(method: str, path: str, body: Any) -> None:
    resp = call(worker(CREDENTIAL), method, path, body, **{c.CREDENTIAL_HEADER: CREDENTIAL})
    # The model is not loaded here: submit is refused for that, not for the credential.
    assert resp.status_code == (503 if path == "/v1/requests" else 200), resp.text


def test_probes_and_metrics_need_no_credential() -> None:
    client = worker(CREDENTIAL)
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 503  # loading, and it says so
    assert client.get("/ready").json()["message"] == "loading model"
    assert client.get("/metrics").status_code == 200


def test_drain_is_a_post_that_takes_the_worker_out() -> None:
    client = worker(CREDENTIAL)
    auth = {c.CREDENTIAL_HEADER: CREDENTIAL}
    assert client.get("/drain", headers=auth).status_code == 405
    assert client.post("/drain", headers=auth).json() == {"drained": True, "in_flight": 0}
    assert client.get("/ready").json()["draining"] is True


def test_without_a_credential_configured_calls_are_open() -> None:
    # Local development without `omnipipe serve`; serve and the operator always set one.
    assert worker(None).post("/drain").status_code == 200


def test_settings_read_the_shared_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(c.CREDENTIAL_ENV, CREDENTIAL)
    assert WorkerSettings(stage="encode").credential == CREDENTIAL


def test_prestop_hook_posts_drain_with_the_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[urllib.request.Request] = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda req, *a, **k: sent.append(req))
    monkeypatch.setenv(c.CREDENTIAL_ENV, CREDENTIAL)
    monkeypatch.setenv("OMNIPIPE_POD_IP", "10.1.2.3")  # not used: loopback skips policies
    exec(DRAIN_SCRIPT, {})  # what the container runs: python3 -c DRAIN_SCRIPT
    [request] = sent
    assert request.get_method() == "POST"
    assert request.full_url == f"http://127.0.0.1:{c.WORKER_CONTROL_PORT}/drain"
    # urllib stores header names capitalize()d.
    assert request.get_header(c.CREDENTIAL_HEADER.capitalize()) == CREDENTIAL
