"""Each benchmark's --quick mode runs end to end (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_autoscale_reaction_quick(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench/autoscale_reaction.py"), "--quick"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=540,
        env={**os.environ, "OMNIPIPE_BENCH_RESULTS": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("autoscale_reaction: up_decision_s=")
    assert "HPA default (replayed)" in proc.stdout
    [line] = (tmp_path / "autoscale_reaction.jsonl").read_text().splitlines()
    result = json.loads(line)
    assert result["quick"] is True
    assert result["machine"]["cpus"] >= 1
    assert result["results"]["up_decision_s"] > 0
