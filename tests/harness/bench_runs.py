"""Running a benchmark's --quick mode and checking what it printed and recorded, for
tests/integration/test_bench_smoke.py: in the test's own process, or in a lane of
benchmarks run one after another beside the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import NoReturn

from omnipipe.local.ports import PORT_RANGE_ENV

REPO = Path(__file__).resolve().parents[2]


def not_json(token: str) -> NoReturn:
    raise ValueError(f"{token} is not JSON")


def run_quick(
    name: str,
    tmp_path: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    started: Callable[[subprocess.Popen[str]], None] | None = None,
) -> tuple[str, dict[str, object]]:
    """bench/<name>.py --quick, its results recorded under tmp_path, checked; `started`
    is given the process (a lane stops it through it)."""
    args = [sys.executable, str(REPO / f"bench/{name}.py"), "--quick", *extra]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMNIPIPE_BENCH_RESULTS": str(tmp_path), **(env or {})},
    )
    if started is not None:
        started(proc)
    try:
        out, err = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return checked(name, tmp_path, subprocess.CompletedProcess(args, proc.returncode, out, err))


def checked(
    name: str, tmp_path: Path, proc: subprocess.CompletedProcess[str]
) -> tuple[str, dict[str, object]]:
    """What a benchmark's run printed and recorded (under tmp_path), each part checked."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"{name}: "), last
    assert all("=" in pair for pair in last.removeprefix(f"{name}: ").split())
    [line] = (tmp_path / f"{name}.jsonl").read_text().splitlines()
    result = json.loads(line, parse_constant=not_json)
    assert result["quick"] is True
    assert result["machine"]["cpus"] >= 1
    # Which code was measured: this checkout's HEAD, marked when it has changes.
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert result["commit"].removesuffix("+changes") == head
    return proc.stdout, result["results"]


class Beside:
    """Benchmarks run one after another in a thread from when it is made, on ports of
    their own (`ports`, an OMNIPIPE_PORT_RANGE); result() waits for one's. stop() ends
    the lane and its running benchmark."""

    def __init__(self, benches: dict[str, tuple[str, ...]], work: Path, ports: str) -> None:
        self.benches, self.work, self.ports = benches, work, ports
        self.runs: dict[str, Future[tuple[str, dict[str, object]]]] = {
            name: Future() for name in benches
        }
        self.stopping = threading.Event()
        self.proc: subprocess.Popen[str] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for name, extra in self.benches.items():
            future = self.runs[name]
            if self.stopping.is_set() or not future.set_running_or_notify_cancel():
                future.cancel()
                continue
            try:
                future.set_result(self._quick(name, extra))
            except BaseException as exc:  # the test that reads it fails with it
                future.set_exception(exc)

    def _quick(self, name: str, extra: tuple[str, ...]) -> tuple[str, dict[str, object]]:
        results = self.work / name
        results.mkdir()
        return run_quick(
            name, results, *extra, env={PORT_RANGE_ENV: self.ports}, started=self._started
        )

    def _started(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def result(self, name: str) -> tuple[str, dict[str, object]]:
        return self.runs[name].result(timeout=600)

    def stop(self) -> None:
        self.stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
        self.thread.join(timeout=60)
