"""A worker whose stage cannot load exits as a failure, so that Kubernetes shows an Error
and backs off (a pod on a real node once showed `Completed` for a thinker that never
loaded, because the worker ended with status 0)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omnipipe.local.ports import free_port

pytestmark = pytest.mark.timeout(120)


def test_a_stage_that_cannot_load_exits_nonzero_and_names_the_reason(tmp_path: Path) -> None:
    pipeline = tmp_path / "broken.yaml"
    pipeline.write_text(
        "apiVersion: omnipipe.io/v1alpha1\n"
        "kind: OmniPipeline\n"
        "metadata: {name: broken}\n"
        f"spec: {{model: {tmp_path / 'no-such-model'}, pipeline: qwen-image}}\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omnipipe.cli",
            "worker",
            "--pipeline",
            str(pipeline),
            "--stage",
            "decode",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--transfer-port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMNIPIPE_CACHE_DIR": str(tmp_path)},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "omnipipe worker: stage decode: load failed:" in proc.stderr, proc.stderr[-3000:]
