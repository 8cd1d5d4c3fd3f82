"""LoRA adapters change under a running `omnipipe serve` without a restart: a reload of
a file whose only change is its adapters keeps the denoise worker (same pid), which
loads the new adapter and unloads the removed one; the router lists and serves the new
set. The worker's PUT /adapters refuses a source it cannot load and keeps its set."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from omnipipe.api.constants import CREDENTIAL_ENV, CREDENTIAL_HEADER
from omnipipe.families.qwen_image.tiny_lora import save_tiny_lora
from tests.e2e.conftest import Served, start_serve, stop_cleanly, wait_line, write_pipeline

CREDENTIAL = "lora-reload-test"


def adapters_yaml(**sources: Path) -> str:
    lines = "".join(
        f"    - {{name: {name}, source: {src}, stage: denoise}}\n" for name, src in sources.items()
    )
    return f"  adapters:\n{lines}" if lines else ""


@pytest.fixture(scope="module")
def loras(tmp_module: Path) -> dict[str, Path]:
    return {
        name: save_tiny_lora(tmp_module / name, seed) for name, seed in (("ink", 1), ("neon", 2))
    }


@pytest.fixture(scope="module")
def served(tmp_module: Path, loras: dict[str, Path]) -> Iterator[Served]:
    s = start_serve(
        write_pipeline(tmp_module, "hot", adapters_yaml(ink=loras["ink"])),
        env={CREDENTIAL_ENV: CREDENTIAL},
    )
    yield s
    stop_cleanly(s)


def models(served: Served) -> set[str]:
    with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
        return {m.id for m in c.models.list()}


def generate(served: Served, model: str) -> None:
    with openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0) as c:
        c.images.generate(
            model=model, prompt="a cat", size="64x64", extra_body={"num_inference_steps": 2}
        )


def test_a_reload_swaps_adapters_in_the_running_worker(
    served: Served, tmp_module: Path, loras: dict[str, Path]
) -> None:
    pid = served.workers["denoise-0"][1]
    assert models(served) == {"hot", "ink"}
    generate(served, "ink")
    mark = len(served.output)
    write_pipeline(tmp_module, "hot", adapters_yaml(neon=loras["neon"]))
    served.proc.send_signal(signal.SIGHUP)
    wait_line(served, "denoise: LoRA adapters now neon", mark)
    wait_line(served, "omnipipe: reloaded", mark)
    assert served.workers["denoise-0"][1] == pid
    assert "denoise-0 ready" not in "".join(served.output[mark:])
    assert models(served) == {"hot", "neon"}
    generate(served, "neon")
    with pytest.raises(openai.NotFoundError):
        generate(served, "ink")


def adapters_call(served: Served, body: object | None = None) -> tuple[int, dict[str, object]]:
    """GET /adapters of the denoise worker, or PUT `body` there."""
    request = urllib.request.Request(
        f"{served.workers['denoise-0'][0]}/adapters",
        method="GET" if body is None else "PUT",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", CREDENTIAL_HEADER: CREDENTIAL},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_source_the_worker_cannot_load_leaves_its_adapters_as_they_were(
    served: Served, tmp_module: Path
) -> None:
    assert adapters_call(served, {"adapters": []}) == (200, {"stage": "denoise", "adapters": []})
    status, body = adapters_call(
        served,
        {"adapters": [{"name": "ghost", "source": str(tmp_module / "none"), "stage": "denoise"}]},
    )
    assert status == 400
    assert "adapters not changed" in str(body["detail"])
    status, body = adapters_call(
        served, {"adapters": [{"name": "x", "source": "/x", "stage": "encode"}]}
    )
    assert status == 400
    assert "not for stage denoise" in str(body["detail"])
    assert adapters_call(served) == (200, {"stage": "denoise", "adapters": []})
