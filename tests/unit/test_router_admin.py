"""The router's admin API (router/api/admin.py) over stage workers that answer their
control calls: the API key guards it, bad bodies are OpenAI-shaped 400s, a call goes to
every replica of the stages it names, and what a stage cannot do is skipped or refused."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from omnipipe.api import parse_resource
from omnipipe.api.resolve import resolve
from omnipipe.router.app import build_app
from omnipipe.router.settings import RouterSettings

pytestmark = pytest.mark.timeout(60)


class StubWorker(BaseHTTPRequestHandler):
    """A stage replica's control API: it records each call; `refuse` answers 409."""

    calls: list[tuple[str, str, dict[str, Any]]]
    refuse: set[str]

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if f"{self.server.server_port}{self.path}" in getattr(self, "stuck", ()):
            time.sleep(10)  # a replica whose control API is stuck (past the read limit)
        if self.path == "/ready":
            port = self.server.server_port
            status = {"pipeline": "p", "stage": "any", "ready": True, "draining": False}
            self._answer(200, {**status, "running": 0, "waiting": 0, "transfer_address": f"{port}"})
        else:
            self._answer(200, {"port": self.server.server_port, "paused": False})

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        self.calls.append((str(self.server.server_port), self.path, body))
        if self.path in self.refuse or f"{self.server.server_port}{self.path}" in self.refuse:
            self._answer(409, {"detail": f"stage cannot {self.path}"})
        else:
            self._answer(200, {"port": self.server.server_port})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def workers() -> Iterator[tuple[list[str], type[StubWorker]]]:
    handler = type("Handler", (StubWorker,), {"calls": [], "refuse": set()})
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(3)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_port}" for s in servers], handler
    for server in servers:
        server.shutdown()
        server.server_close()


def app_over(
    tmp_path: Path, urls: list[str], api_key: str | None, admin_api_key: str | None = None
) -> TestClient:
    pipeline = resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "p"},
                "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image"},
            }
        )
    )
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps({"encode": [urls[0]], "denoise": urls[1:], "decode": []}))
    settings = RouterSettings(
        replicas_file=str(replicas), api_key=api_key, admin_api_key=admin_api_key
    )
    return TestClient(build_app(pipeline, settings))


def test_the_admin_api_takes_the_api_key(
    tmp_path: Path, workers: tuple[list[str], type[StubWorker]]
) -> None:
    urls, handler = workers
    with app_over(tmp_path, urls, api_key="secret") as client:
        refused = client.post("/admin/pause", json={})
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert handler.calls == []
        ok = client.post("/admin/pause", json={}, headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200


@pytest.mark.parametrize("api_key", ["client", None], ids=["api-keyed", "api-open"])
def test_an_admin_key_guards_the_admin_api_alone(
    tmp_path: Path, workers: tuple[list[str], type[StubWorker]], api_key: str | None
) -> None:
    urls, handler = workers
    with app_over(tmp_path, urls, api_key=api_key, admin_api_key="ops") as client:
        for header in ({}, {"Authorization": "Bearer client"}):
            for call in (
                lambda h: client.post("/admin/pause", json={}, headers=h),
                lambda h: client.get("/admin/stages", headers=h),
                lambda h: client.post("/admin/loras", json={}, headers=h),
            ):
                refused = call(header)
                assert refused.status_code == 401, refused.text
                assert refused.json()["error"]["code"] == "invalid_api_key"
        assert handler.calls == []
        ok = client.post("/admin/pause", json={}, headers={"Authorization": "Bearer ops"})
        assert ok.status_code == 200
        # The API takes its own key (or none), never the admin's.
        models = client.get("/v1/models", headers={"Authorization": "Bearer ops"})
        assert models.status_code == (401 if api_key else 200)
        if api_key:
            mine = client.get("/v1/models", headers={"Authorization": f"Bearer {api_key}"})
            assert mine.status_code == 200


def test_a_call_reaches_every_replica_of_the_stages_it_names(
    tmp_path: Path, workers: tuple[list[str], type[StubWorker]]
) -> None:
    urls, handler = workers
    with app_over(tmp_path, urls, api_key=None) as client:
        answer = client.post("/admin/sleep", json={"stages": ["denoise"], "level": 2}).json()
        assert sorted(r["replica"] for r in answer["stages"]["denoise"]) == sorted(urls[1:])
        assert sorted(port for port, _, _ in handler.calls) == sorted(
            u.rsplit(":", 1)[1] for u in urls[1:]
        )
        assert {(path, json.dumps(body)) for _, path, body in handler.calls} == {
            ("/control/sleep", '{"level": 2}')
        }
        handler.calls.clear()
        everyone = client.post("/admin/pause", json={"mode": "wait"}).json()
        assert set(everyone["stages"]) == {"encode", "denoise", "decode"}
        assert len(handler.calls) == 3  # decode has no replica: nothing to pause
        assert everyone["stages"]["decode"] == []
        states = client.get("/admin/stages").json()["stages"]
        assert len(states["denoise"]) == 2
        assert states["denoise"][0]["paused"] is False


def test_a_stage_that_cannot_is_skipped_unless_named(
    tmp_path: Path, workers: tuple[list[str], type[StubWorker]]
) -> None:
    urls, handler = workers
    handler.refuse = {"/control/reset_cache"}
    with app_over(tmp_path, urls, api_key=None) as client:
        # Every stage with a replica refuses: none did it, so a 409 that says why.
        every = client.post("/admin/reset_prefix_cache")
        assert every.status_code == 409
        assert every.json()["error"]["type"] == "invalid_request_error"
        assert "stage cannot /control/reset_cache" in every.json()["error"]["message"]
        # Only encode refuses: skipped, and named in the answer.
        handler.refuse = {urls[0].rsplit(":", 1)[1] + "/control/reset_cache"}
        some = client.post("/admin/reset_prefix_cache").json()
        assert set(some["stages"]) == {"denoise", "decode"}
        assert len(some["stages"]["denoise"]) == 2
        assert some["skipped"] == {"encode": "stage cannot /control/reset_cache"}
        # One denoise replica refuses (still busy, say), the other sleeps: not done, a 409.
        handler.refuse = {urls[1].rsplit(":", 1)[1] + "/control/sleep"}
        partly = client.post("/admin/sleep")
        assert partly.status_code == 409
        assert partly.json()["error"]["code"] == "not_done"
        handler.refuse = {"/control/profile/start"}
        # Only encode's replica is asked (the stub refuses for all of them), named: 409.
        named = client.post("/admin/start_profile", json={"stages": ["encode"]})
        assert named.status_code == 409


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/admin/pause", {"mode": "later"}, "mode"),
        ("/admin/sleep", {"level": 3}, "level"),
        ("/admin/pause", {"stages": ["vocoder"]}, "stages[0]"),
        ("/admin/pause", {"stages": []}, "stages"),
        ("/admin/pause", {"wait": True}, "wait"),
    ],
)
def test_bad_admin_calls_are_openai_shaped_400s(
    tmp_path: Path,
    workers: tuple[list[str], type[StubWorker]],
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    urls, handler = workers
    with app_over(tmp_path, urls, api_key=None) as client:
        resp = client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
        assert handler.calls == []
        assert client.post("/admin/levitate").status_code == 400


def test_adapters_are_changed_in_the_file_or_the_resource_not_here(
    tmp_path: Path, workers: tuple[list[str], type[StubWorker]]
) -> None:
    urls, _ = workers
    with app_over(tmp_path, urls, api_key=None) as client:
        assert client.get("/admin/loras").json() == {"adapters": []}
        refused = client.post("/admin/loras", json={"name": "ink"})
        assert refused.status_code == 409
        assert "pipeline file's spec.adapters" in refused.json()["error"]["message"]
        assert client.delete("/admin/loras/ink").status_code == 409


def test_a_stuck_replica_does_not_hold_the_state_of_the_others(
    tmp_path: Path, workers: tuple[list[str], type[StubWorker]]
) -> None:
    """/admin/stages asks every replica at once, each for at most READ_TIMEOUT_SECONDS:
    one that never answers is reported as such beside the others' states."""
    from omnipipe.router.api.admin import READ_TIMEOUT_SECONDS

    urls, handler = workers
    stuck_port = urls[1].rsplit(":", 1)[1]
    handler.stuck = {f"{stuck_port}/control"}  # type: ignore[attr-defined]
    with app_over(tmp_path, urls, api_key=None) as client:
        started = time.monotonic()
        answer = client.get("/admin/stages")
        took = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    assert READ_TIMEOUT_SECONDS <= took < READ_TIMEOUT_SECONDS + 10
    replicas = {r["replica"]: r for rs in answer.json()["stages"].values() for r in rs}
    assert replicas[urls[1]]["error"] == f"no answer within {READ_TIMEOUT_SECONDS:g} s"
    assert replicas[urls[0]]["paused"] is False
    assert replicas[urls[2]]["paused"] is False
