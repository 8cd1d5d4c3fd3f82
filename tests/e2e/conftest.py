"""`omnipipe serve` as a user runs it, with its workers as real processes and the tiny
real Qwen-Image weights; clients are the official openai package and curl."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from PIL import Image

from omnipipe.local.ports import PORT_RANGE_ENV, free_port, port_range
from tests.e2e.omni_variants import VARIANTS, Variant

REPO = Path(__file__).resolve().parents[2]
E2E = Path(__file__).resolve().parent
READY_LINE = re.compile(r"\[\d+/\d+\] (\S+) ready at (\S+) \(pid (\d+)\)")
RESTART_LINE = re.compile(r"omnipipe: (\S+) exited with code \S+; restarting as pid (\d+)")
# How much of a running serve's output a failed test's report carries.
REPORTED_LINES = 120


@dataclass
class Served:
    proc: subprocess.Popen[str]
    base_url: str
    workers: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (url, pid)
    output: list[str] = field(default_factory=list)
    pump: threading.Thread | None = None

    def metrics(self, worker: str) -> str:
        with urllib.request.urlopen(f"{self.workers[worker][0]}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def metric(self, worker: str, name: str) -> float:
        total = 0.0
        for line in self.metrics(worker).splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def busy_replica(self, names: tuple[str, ...], timeout: float = 20) -> str:
        """The first of `names` seen running a request."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name in names:
                if self.metric(name, "omnipipe_stage_requests_running") > 0:
                    return name
            time.sleep(0.02)
        raise AssertionError(f"none of {names} started a request within {timeout}s")

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            RUNNING.remove(self)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C, as a user stops it
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.pump is not None:
            # EOF arrives once every process holding the pipe is gone.
            self.pump.join(timeout=30)
        if self.proc.stdout is not None and (self.pump is None or not self.pump.is_alive()):
            self.proc.stdout.close()


# Every serve started and not yet stopped: a failing test's report shows their output.
RUNNING: list[Served] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    """A test that fails beside a running serve carries the tail of its output (the
    workers' logs, a worker's exit code and restart), which a CI log otherwise lacks."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for served in RUNNING:
            tail = "".join(served.output[-REPORTED_LINES:])
            report.sections.append((f"omnipipe serve at {served.base_url}", tail))


def start_serve(
    manifest: Path | str,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    code: Path = REPO,
    args: tuple[str, ...] = (),
) -> Served:
    """`omnipipe serve` of `manifest` (with more of serve's flags: `args`), from the
    checkout at `code` (another commit's worktree, for a benchmark's anchor), once it says
    it is ready."""
    port = free_port()
    pythonpath = {} if code == REPO else {"PYTHONPATH": str(code)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omnipipe.cli",
            "serve",
            str(manifest),
            "--port",
            str(port),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=code,
        start_new_session=True,
        env={**os.environ, "UCX_NET_DEVICES": "lo", **pythonpath, **(env or {})},
    )
    served = Served(proc, f"http://127.0.0.1:{port}/v1")
    RUNNING.append(served)
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        with contextlib.suppress(ValueError):  # the pipe is closed by stop()
            for line in proc.stdout:
                _record(line)

    def _record(line: str) -> None:
        served.output.append(line)
        if m := READY_LINE.search(line):
            served.workers[m[1]] = (m[2], int(m[3]))
        # A worker that crashes before its first ready line is listed once it is ready.
        if (m := RESTART_LINE.search(line)) and m[1] in served.workers:
            served.workers[m[1]] = (served.workers[m[1]][0], int(m[2]))
        if "omnipipe: ready." in line:
            ready.set()

    served.pump = threading.Thread(target=pump, daemon=True)
    served.pump.start()
    deadline = time.monotonic() + timeout
    try:
        while not ready.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    "omnipipe serve did not become ready:\n" + "".join(served.output[-60:])
                )
    except BaseException:
        # Not ready, or interrupted while it starts (pytest-timeout, Ctrl-C): a serve
        # nobody holds would go on loading its models beside the tests after it.
        served.stop()
        raise
    return served


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Every fixture has stopped its serves by now: one still running was lost by a test
    (interrupted between its start and its stop), and must not outlive the session (an
    xdist worker's, whose serves would otherwise run on beside the other worker's)."""
    for served in list(RUNNING):
        print(f"\nomnipipe serve at {served.base_url} was still running: stopping it")
        served.stop()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def stop_cleanly(served: Served) -> None:
    """Ctrl-C, then: exit code 0 and no worker left behind."""
    pids = [pid for _, pid in served.workers.values()]
    served.stop()
    assert served.proc.returncode == 0, "".join(served.output[-30:])
    time.sleep(0.5)
    assert pids_alive(pids) == [], "omnipipe serve left orphan processes"


SHARED_SERVE_GROUP = "omni_served"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker's serves pick their ports from a share of the range
    of their own (OMNIPIPE_PORT_RANGE, which every serve and worker inherits): a port is
    picked free and bound seconds later, so two workers' serves starting at once could
    pick the same one (seen: a worker's control port bound first by another serve's
    transfer listener; omnipipe/local/ports.py)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    index, count = int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    low, high = port_range()
    share = (high - low + 1) // count
    os.environ[PORT_RANGE_ENV] = f"{low + index * share}-{low + (index + 1) * share - 1}"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks (its hook appends @group)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `pytest -n N --dist loadgroup` (make e2e), each xdist worker is a session of
    its own, and a module's fixtures are set up on every worker that runs one of its
    tests. So every test is in its module's group, and the modules that share the
    session's omni_served serves are in one group: a module's serve starts once, and each
    Qwen-Omni variant's once, as in a serial run. Without xdist the marks change nothing."""
    here = [item for item in items if item.path.is_relative_to(E2E)]  # `pytest tests` too
    shared = {item.path for item in here if "omni_served" in getattr(item, "fixturenames", ())}
    for item in here:
        if item.get_closest_marker("xdist_group") is None:
            group = SHARED_SERVE_GROUP if item.path in shared else item.path.stem
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session", params=list(VARIANTS), ids=list(VARIANTS))
def omni_variant(request: pytest.FixtureRequest) -> Variant:
    return VARIANTS[str(request.param)]


@pytest.fixture(scope="session")
def omni_served(
    tmp_path_factory: pytest.TempPathFactory, omni_variant: Variant
) -> Iterator[Served]:
    """One serve of a tiny Qwen-Omni variant for every module that asks for it: pytest
    runs those modules' tests of one variant together, and stops the serve before it
    starts the next variant's, so one is running at a time (each costs ~30 s to start)."""
    manifest = tmp_path_factory.mktemp("omni") / f"{omni_variant.pipeline}.yaml"
    manifest.write_text(omni_variant.manifest())
    served = start_serve(manifest)
    yield served
    stop_cleanly(served)


@pytest.fixture
def omni_client(omni_served: Served) -> Iterator[openai.OpenAI]:
    """The openai client of the variant's serve."""
    client = openai.OpenAI(base_url=omni_served.base_url, api_key="unused", max_retries=0)
    yield client
    client.close()


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


def write_pipeline(
    directory: Path,
    name: str,
    stages: str = "",
    transfer: str = "ucx",
    model: str = "tiny://qwen-image",
    file: str = "",
) -> Path:
    path = directory / f"{file or name}.yaml"
    path.write_text(
        "apiVersion: omnipipe.io/v1alpha1\nkind: OmniPipeline\n"
        f"metadata: {{name: {name}}}\n"
        f"spec:\n  model: {model}\n  pipeline: qwen-image\n"
        f"  transfer: {{backend: {transfer}}}\n{stages}"
    )
    return path


def assert_serves_a_small_image(base_url: str, model: str, steps: int = 2) -> None:
    """The official openai client gets a 64x64 image from the router at base_url (its
    /v1 URL, or the root)."""
    url = base_url if base_url.endswith("/v1") else f"{base_url}/v1"
    with openai.OpenAI(base_url=url, api_key="any", max_retries=0) as c:
        r = c.images.generate(
            model=model,
            prompt="a lighthouse",
            size="64x64",
            extra_body={"num_inference_steps": steps},
        )
    img = Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json or "")))
    assert img.size == (64, 64)


def wait_line(served: Served, text: str, after: int, timeout: float = 240) -> int:
    """The index of the first output line from `after` on that contains `text`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i in range(after, len(served.output)):
            if text in served.output[i]:
                return i
        assert served.proc.poll() is None, "".join(served.output[-40:])
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} within {timeout}s:\n" + "".join(served.output[-40:]))
