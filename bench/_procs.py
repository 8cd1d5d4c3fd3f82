"""Child processes for the benchmarks: start, wait until they answer, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from _common import REPO


def wait_http(url: str, timeout: float = 60, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout:g}s")


@contextmanager
def running(
    args: list[str],
    ready_url: str,
    log: Path,
    env: dict[str, str] | None = None,
    wait: bool = True,
) -> Iterator[subprocess.Popen[bytes]]:
    """A child in its own process group, its output in `log`; killed with its group.
    wait=False: yielded once started, for the caller to wait_http() on it later."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        try:
            if wait:
                wait_http(ready_url, proc=proc)
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def answering_child(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """A child whose first line on stdout (after UCX's own messages, which start with
    '[') is its answer, such as an address; its stdin stays open for a reply."""
    proc = start_child(argv, env)
    return proc, answer_of(proc)


def start_child(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """answering_child's child, started; answer_of() waits for its answer."""
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    )


def answer_of(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line.startswith("["):
        line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before it answered")
    return line.strip()
