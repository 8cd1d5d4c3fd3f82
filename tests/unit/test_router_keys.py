"""Keys that open nothing by accident: an empty or blank API key or credential stops the
process at start, naming the variable, and a request with two Authorization headers is
refused whichever of them is right."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from omnipipe.cli import main
from omnipipe.router.metrics import RouterMetrics
from omnipipe.router.middleware import GuardMiddleware
from omnipipe.router.settings import RouterSettings
from omnipipe.worker.settings import WorkerSettings
from tests.e2e.conftest import REPO

PIPELINE = str(REPO / "examples/tiny-omni.yaml")


@pytest.mark.parametrize("value", ["", " ", "\t\n"])
@pytest.mark.parametrize(
    ("command", "variable"),
    [
        (["router", "--pipeline", PIPELINE], "OMNIPIPE_ROUTER_API_KEY"),
        (["router", "--pipeline", PIPELINE], "OMNIPIPE_ROUTER_ADMIN_API_KEY"),
        (["router", "--pipeline", PIPELINE], "OMNIPIPE_PIPELINE_CREDENTIAL"),
        (["worker", "--pipeline", PIPELINE, "--stage", "thinker"], "OMNIPIPE_PIPELINE_CREDENTIAL"),
    ],
)
def test_an_empty_key_stops_the_process_at_start_naming_the_variable(
    command: list[str],
    variable: str,
    value: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert f"omnipipe {command[0]}: {variable}: is set but empty" in err
    assert "Traceback" not in err


def test_a_key_with_stray_whitespace_is_refused_and_a_real_one_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMNIPIPE_ROUTER_API_KEY", "secret\n")
    with pytest.raises(ValidationError, match="whitespace"):
        RouterSettings()
    monkeypatch.setenv("OMNIPIPE_ROUTER_API_KEY", "secret")
    assert RouterSettings().api_key == "secret"
    monkeypatch.delenv("OMNIPIPE_ROUTER_API_KEY")
    assert RouterSettings().api_key is None  # unset: no key, as before
    monkeypatch.setenv("OMNIPIPE_PIPELINE_CREDENTIAL", "c")
    assert WorkerSettings().credential == "c"


async def reached(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"in"})


@pytest.mark.parametrize(
    "headers",
    [
        [("Authorization", "Bearer right"), ("Authorization", "Bearer wrong")],
        [("Authorization", "Bearer wrong"), ("Authorization", "Bearer right")],
        [("Authorization", "Bearer right"), ("Authorization", "Bearer right")],
        [("Authorization", "Bearer ")],
        [("Authorization", "Bearer")],
        [],
    ],
)
def test_only_one_authorization_header_with_the_key_opens_a_route(
    headers: list[tuple[str, str]],
) -> None:
    app = GuardMiddleware(
        reached, pipeline="p", api_key="right", max_body_bytes=1024, metrics=RouterMetrics.create()
    )
    client = TestClient(app)  # no `with`: a bare ASGI app has no lifespan
    refused = client.get("/v1/models", headers=headers)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    ok = client.get("/v1/models", headers={"Authorization": "Bearer right"})
    assert (ok.status_code, ok.text) == (200, "in")
