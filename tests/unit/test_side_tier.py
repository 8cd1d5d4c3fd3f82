"""`make test`'s side tier (hack/side_tier.py): the real-node tier runs beside the others
once its set-up has ended, and the lanes stop each other."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.harness.hack_modules import hack_module

Started = Callable[[subprocess.Popen[bytes]], None]


@pytest.fixture(scope="module")
def side() -> ModuleType:
    module = hack_module("side_tier")
    return module


def run_process(args: list[str]) -> Callable[[Started], tuple[int, float, float | None]]:
    def run(started: Started) -> tuple[int, float, float | None]:
        proc = subprocess.Popen(args)
        started(proc)
        return proc.wait(), 0.0, None

    return run


def test_it_runs_after_its_set_up_and_beside_the_caller(side: ModuleType, tmp_path: Path) -> None:
    setup_done, may_end, ran = threading.Event(), threading.Event(), threading.Event()

    def run(started: Started) -> tuple[int, float, float | None]:
        ran.set()
        assert may_end.wait(10)
        return 0, 1.0, None

    tier = side.SideTier("realnode", lambda: 0 if setup_done.wait(10) else 1, run, tmp_path / "x")
    time.sleep(0.1)
    assert not ran.is_set(), "it ran before its set-up ended"
    setup_done.set()
    assert ran.wait(10)
    # Running, and the caller goes on: nothing has ended, nothing has failed.
    assert tier.result is None
    assert not tier.failed()
    may_end.set()
    tier.join()
    assert tier.result == (0, 1.0, None)
    assert not tier.failed()


def test_after_a_failed_set_up_nothing_runs(side: ModuleType, tmp_path: Path) -> None:
    ran = threading.Event()

    def run(started: Started) -> tuple[int, float, float | None]:
        ran.set()
        return 0, 0.0, None

    tier = side.SideTier("realnode", lambda: 2, run, tmp_path / "x")
    tier.join()
    assert tier.setup_rc == 2
    assert not ran.is_set()


def test_a_failed_run_is_a_failure(side: ModuleType, tmp_path: Path) -> None:
    tier = side.SideTier("realnode", lambda: 0, run_process(["false"]), tmp_path / "x")
    tier.join()
    assert tier.result is not None
    assert tier.result[0] == 1
    assert tier.failed()


def test_cancel_stops_a_running_tier_as_ctrl_c_would(side: ModuleType, tmp_path: Path) -> None:
    # Its own Ctrl-C handler: a test run started in the background inherits SIGINT ignored
    # (hack/test_tiers.py gives its tiers the default).
    code = (
        "import signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    raise SystemExit(42)"
    )
    marker = tmp_path / "started"
    script = f"open({str(marker)!r}, 'w').close()\n{code}"
    tier = side.SideTier(
        "realnode", lambda: 0, run_process([sys.executable, "-c", script]), tmp_path / "x"
    )
    deadline = time.monotonic() + 20
    while not marker.exists():
        assert time.monotonic() < deadline, "the tier's process never started"
        time.sleep(0.05)
    began = time.monotonic()
    tier.cancel()
    tier.join()
    # 42: its KeyboardInterrupt handler ran (SIGINT, so a pytest's teardowns run).
    assert tier.result is not None
    assert tier.result[0] == 42
    assert time.monotonic() - began < 10


def test_cancel_before_the_set_up_ends_keeps_it_from_starting(
    side: ModuleType, tmp_path: Path
) -> None:
    setup_done, ran = threading.Event(), threading.Event()

    def run(started: Started) -> tuple[int, float, float | None]:
        ran.set()
        return 0, 0.0, None

    tier = side.SideTier("realnode", lambda: 0 if setup_done.wait(10) else 1, run, tmp_path / "x")
    tier.cancel()
    setup_done.set()
    tier.join()
    assert not ran.is_set()
    assert tier.result is None


def test_its_output_is_printed_once(
    side: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "realnode.log"

    def run(started: Started) -> tuple[int, float, float | None]:
        log.write_text("14 passed\n")
        return 0, 0.0, None

    tier = side.SideTier("realnode", lambda: 0, run, log)
    tier.join()
    tier.join()
    assert capsys.readouterr().out.count("14 passed") == 1


def wait_for_file(path: Path, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_cancel_twice_sends_one_sigint(side: ModuleType, tmp_path: Path) -> None:
    """A second SIGINT would cut a pytest's teardown (the node's) short: cancel is once."""
    marker, count = tmp_path / "started", tmp_path / "sigints"
    script = (
        "import signal, time\n"
        f"def count(*_):\n    open({str(count)!r}, 'a').write('x')\n"
        "signal.signal(signal.SIGINT, count)\n"
        f"open({str(marker)!r}, 'w').close()\n"
        "time.sleep(1.5)\n"
    )
    tier = side.SideTier(
        "realnode", lambda: 0, run_process([sys.executable, "-c", script]), tmp_path / "x"
    )
    wait_for_file(marker)
    tier.cancel()
    tier.cancel()
    tier.join()
    assert count.read_text() == "x"
    assert tier.stopped


def test_a_tier_that_ignores_its_sigint_is_killed_after_the_grace(
    side: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(side, "STOP_GRACE_SECONDS", 0.5)
    marker = tmp_path / "started"
    script = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        f"open({str(marker)!r}, 'w').close()\n"
        "time.sleep(60)\n"
    )

    def run(started: Started) -> tuple[int, float, float | None]:
        # In a process group of its own, as hack/test_tiers.py starts the side tier.
        proc = subprocess.Popen([sys.executable, "-c", script], process_group=0)
        started(proc)
        return proc.wait(), 0.0, None

    tier = side.SideTier("realnode", lambda: 0, run, tmp_path / "x")
    wait_for_file(marker)
    began = time.monotonic()
    tier.cancel()
    tier.join()
    assert tier.result is not None
    assert tier.result[0] == -9  # SIGKILL
    assert time.monotonic() - began < 10


def test_a_lane_that_breaks_is_a_failure_not_a_pass(side: ModuleType, tmp_path: Path) -> None:
    def run(started: Started) -> tuple[int, float, float | None]:
        raise PermissionError("the log cannot be written")

    tier = side.SideTier("realnode", lambda: 0, run, tmp_path / "x")
    tier.join()
    assert tier.result is None
    assert isinstance(tier.error, PermissionError)
    assert tier.failed()


def test_a_failed_set_up_is_the_set_ups_failure_not_the_tiers(
    side: ModuleType, tmp_path: Path
) -> None:
    """The main lane's next tier waits only for its own set-up steps (the integration
    tier does not need the node's): a step that only the side tier needs does not stop it."""
    tier = side.SideTier("realnode", lambda: 2, run_process(["true"]), tmp_path / "x")
    tier.join()
    assert tier.setup_rc == 2
    assert not tier.failed()
