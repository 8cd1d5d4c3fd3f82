"""`omnipipe serve`s for the benchmarks: several started together (--quick), and a
baseline commit's worktree to serve from.

A serve's start is most of a smoke run, and on a 2-core machine one start leaves a core
idle much of the time (a vLLM engine starts on one core). A --quick run starts the serves
it needs at once, then measures them one at a time as a full run does; each is stopped
after its own measurement, so those not yet measured sit idle beside it.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from _common import REPO

from tests.e2e.conftest import Served, start_serve


class Together:
    """The serves of `texts` (manifests by name), started at once in the background: what
    the caller does before its first take() overlaps their start. take(name) waits until
    every one is ready and hands that one over, for the caller to measure and stop;
    close() stops those not taken. If one does not start, the others are stopped and its
    error raised."""

    def __init__(self, work: Path, texts: dict[str, str], timeout: float = 300) -> None:
        self.started = time.monotonic()
        self.pool = ThreadPoolExecutor(max(1, len(texts)))
        self.futures = {
            name: self.pool.submit(_start, path, timeout)
            for name, path in write_manifests(work, texts).items()
        }
        self.ready: dict[str, Served] | None = None

    def _wait(self) -> dict[str, Served]:
        if self.ready is None:
            self.pool.shutdown(wait=True)
            futures = self.futures.items()
            self.ready = {name: f.result() for name, f in futures if f.exception() is None}
            if errors := [e for _, f in futures if (e := f.exception()) is not None]:
                self.close()
                raise errors[0]
            if self.futures:
                took = time.monotonic() - self.started
                names = ", ".join(self.futures)
                print(f"{names}: serves started together, ready in {took:.0f}s", flush=True)
        return self.ready

    def take(self, name: str) -> Served | None:
        return self._wait().pop(name, None) if name in self.futures else None

    def take_all(self) -> dict[str, Served]:
        ready, self.ready = self._wait(), {}
        return ready

    def close(self) -> None:
        for served in self._wait().values():
            served.stop()
        self.ready = {}


def _start(path: Path, timeout: float) -> Served:
    """start_serve, once more if a port it picked was bound by another before it: serves
    starting together pick theirs from one range, each unaware of the others' picks."""
    try:
        return start_serve(path, timeout=timeout)
    except AssertionError as exc:
        if "address already in use" not in str(exc):
            raise
        print(f"{path.name}: a port was taken before serve bound it; starting again", flush=True)
    return start_serve(path, timeout=timeout)


def write_manifests(work: Path, texts: dict[str, str]) -> dict[str, Path]:
    """Each manifest text in a file of `work`, by name."""
    paths = {}
    for i, (name, text) in enumerate(texts.items()):
        paths[name] = work / f"together-{i}.yaml"
        paths[name].write_text(text)
    return paths


@contextmanager
def serving(work: Path, texts: dict[str, str]) -> Iterator[Together]:
    """Together(work, texts), closed on the way out; no texts, no serves (take() gives
    None, for the caller to start its own)."""
    together = Together(work, texts)
    try:
        yield together
    finally:
        together.close()


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="omnipipe-baseline-"))
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False
        )
        shutil.rmtree(path, ignore_errors=True)
