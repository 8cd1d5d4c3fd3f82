"""A worker whose stage cannot load exits as a failure, so that Kubernetes shows an Error
and backs off (a pod on a real node once showed `Completed` for a thinker that never
loaded, because the worker ended with status 0)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.local.ports import free_port
from omnipipe.worker.main import report_termination

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


def test_a_missing_model_directory_is_never_taken_for_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a node with no way out, diffusers' guess (the Hub) cost minutes of DNS
    timeouts per crash before the pod even reached CrashLoopBackOff."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no such directory, and not a Hugging Face id"):
        resolve_model_path(missing)
    (tmp_path / "here").mkdir()
    assert resolve_model_path(str(tmp_path / "here")) == str(tmp_path / "here")
    assert resolve_model_path("Qwen/Qwen-Image") == "Qwen/Qwen-Image"


def test_the_termination_message_is_one_line_and_only_in_a_container(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    report_termination("stage encode: load failed: first\n\n  second\n", log)
    assert not log.exists()  # no file: not in a container, nothing written
    log.touch()
    report_termination("stage encode: load failed: first\n\n  second\n", log)
    assert log.read_text() == "stage encode: load failed: first second"
    report_termination("x" * 10_000, log)
    assert len(log.read_text()) == 4000
