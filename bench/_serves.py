"""`omnipipe serve`s for the benchmarks: several started together (--quick), serves that
a smoke run shares between benchmarks, and a baseline commit's worktree to serve from.

A serve's start is most of a smoke run, and on a 2-core machine one start leaves a core
idle much of the time (a vLLM engine starts on one core). A --quick run starts the serves
it needs at once, then measures them one at a time as a full run does; each is stopped
after its own measurement, so those not yet measured sit idle beside it.

Several benchmarks run the same pipeline (tiny://qwen-image as it comes; tiny://qwen2.5-omni
with its thinker on vLLM). The smoke tests (tests/integration/test_bench_smoke.py) start
each of those once and name them in $OMNIPIPE_BENCH_SHARED_SERVES, a JSON list of
{"pipeline": the resolved pipeline's YAML, "base_url", "pid", "workers": {name: [url,
pid]}}. A benchmark about to start a serve of a pipeline listed there, as omnipipe
resolves it, borrows that one instead and leaves it running; the smoke test stops it,
cleanly, after the last benchmark that borrows it. A full run (no such file) starts its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from _common import REPO

from tests.e2e.conftest import Served, start_serve, stop_cleanly

SHARED_SERVES = "OMNIPIPE_BENCH_SHARED_SERVES"


def resolved(text: str) -> str:
    """The pipeline a manifest runs, as omnipipe resolves it (defaults filled in): two
    manifests that differ only in what they spell out resolve alike."""
    from omnipipe.api.loading import load_pipeline, pipeline_yaml

    with tempfile.TemporaryDirectory(prefix="omnipipe-bench-") as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(text)
        return pipeline_yaml(load_pipeline(path))


class _Elsewhere:
    """A shared serve's process as a borrower sees it: its pid, and running. It is the
    smoke test's child, not the borrower's, so the borrower neither waits for nor stops it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        return None


class Borrowed(Served):
    """A serve that the smoke test shares: measured like one's own, left running."""

    def stop(self) -> None:
        pass


def borrow(text: str) -> Borrowed | None:
    """The shared serve of `text`'s pipeline, if the smoke test started one."""
    listing = os.environ.get(SHARED_SERVES)
    if not listing:
        return None
    entries = json.loads(Path(listing).read_text())
    want = resolved(text)
    for entry in entries:
        if entry["pipeline"] == want:
            workers = {name: (url, int(pid)) for name, (url, pid) in entry["workers"].items()}
            proc = cast(Any, _Elsewhere(int(entry["pid"])))
            print(f"borrowing the shared serve at {entry['base_url']}", flush=True)
            return Borrowed(proc, str(entry["base_url"]), workers)
    return None


def release(served: Served) -> None:
    """stop_cleanly() a serve of one's own (exit code 0, no worker left behind); a
    borrowed one stays up for the next benchmark and is checked so when the smoke test
    stops it."""
    if not isinstance(served, Borrowed):
        stop_cleanly(served)


class Releasing:
    """release() of the serves handed to it: each at once (background=False, as a full
    run does), or (--quick) in the background, its stop (seconds of waiting on its
    processes' exits) overlapping what is measured next. join() waits for every stop and
    raises the first failure; a `with` calls it on the way out (when nothing else is raised)."""

    def __init__(self, background: bool) -> None:
        self.pool = ThreadPoolExecutor(4) if background else None
        self.stops: list[Future[None]] = []

    def __call__(self, served: Served) -> None:
        if self.pool is None:
            release(served)
        else:
            self.stops.append(self.pool.submit(release, served))

    def join(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if errors := [e for f in self.stops if (e := f.exception()) is not None]:
            raise errors[0]

    def __enter__(self) -> Releasing:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.join()
        elif self.pool is not None:  # stops waited for, the error on its way out kept
            self.pool.shutdown(wait=True)


class Together:
    """The serves of `texts` (manifests by name), started at once in the background: what
    the caller does before its first take() overlaps their start. take(name) waits until
    every one is ready and hands that one over, for the caller to measure and stop;
    close() stops those not taken. If one does not start, the others are stopped and its
    error raised. A serve borrowed from the smoke test is not started, and take() hands it
    over at once: measuring it overlaps the others' start."""

    def __init__(self, work: Path, texts: dict[str, str], timeout: float = 300) -> None:
        self.started = time.monotonic()
        shared = {name: b for name, text in texts.items() if (b := borrow(text)) is not None}
        own = {name: text for name, text in texts.items() if name not in shared}
        self.pool = ThreadPoolExecutor(max(1, len(own)))
        self.futures = {
            name: self.pool.submit(_start, path, timeout)
            for name, path in write_manifests(work, own).items()
        }
        self.shared: dict[str, Served] = dict(shared)
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

    def wait(self) -> None:
        """Until every serve started here is ready (raising as take() does): what the
        caller measures next then runs beside idle serves, not starting ones."""
        self._wait()

    def take(self, name: str) -> Served | None:
        if name in self.shared:
            return self.shared.pop(name)
        return self._wait().pop(name, None) if name in self.futures else None

    def take_all(self) -> dict[str, Served]:
        ready, self.ready = self._wait(), {}
        shared, self.shared = self.shared, {}
        return {**shared, **ready}

    def close(self) -> None:
        for served in self._wait().values():
            served.stop()
        self.ready, self.shared = {}, {}


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
