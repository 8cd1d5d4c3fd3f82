"""`make test`'s background set-up (hack/background_setup.py): a tier waits for the steps
it uses, not for the whole set-up, and the set-up runs at the lowest priority."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.harness.hack_modules import hack_module


@pytest.fixture(scope="module")
def bg() -> ModuleType:
    module = hack_module("background_setup")
    module.POLL_SECONDS = 0.05
    return module


def step(name: str, status: str = "ok") -> str:
    """A shell line that records a step's end as hack/timed.sh does."""
    return f"printf '{name}\\t0.1\\t{status}\\t0.1\\n' >> setup.tsv"


def test_a_tier_goes_on_once_its_steps_end_while_the_rest_runs(
    bg: ModuleType, tmp_path: Path
) -> None:
    # The rest of the set-up waits for the test's word, so the order is what is checked,
    # whatever the machine's load (the set-up runs at nice 19).
    release = tmp_path / "release"
    wait_for_release = f"while [ ! -e {release} ]; do sleep 0.05; done"
    command = f"{step('a')}; {step('b')}; {wait_for_release}; {step('c')}"
    setup = bg.BackgroundSetup(command, tmp_path, tmp_path)
    try:
        rc, _ = setup.wait_for({"a", "b"}, "integration")
        assert rc == 0
        assert setup.proc.returncode is None, "the set-up was waited for whole"
        release.touch()
        rc, _ = setup.join()
        assert rc == 0
        assert "c\t" in (tmp_path / "setup.tsv").read_text()  # join waited for the rest
        assert setup.result is not None
        assert setup.result[0] == 0
    finally:
        setup.stop()


def test_a_failed_step_that_a_tier_needs_stops_the_wait(bg: ModuleType, tmp_path: Path) -> None:
    setup = bg.BackgroundSetup(f"{step('a', 'failed (exit 2)')}; exit 2", tmp_path, tmp_path)
    try:
        rc, _ = setup.wait_for({"a"}, "integration")
        assert rc == 2
    finally:
        setup.stop()


def test_a_set_up_that_ends_without_a_needed_step_fails_the_wait(
    bg: ModuleType, tmp_path: Path
) -> None:
    started = time.monotonic()
    setup = bg.BackgroundSetup(step("a"), tmp_path, tmp_path)
    try:
        rc, _ = setup.wait_for({"a", "typo"}, "integration")
        assert rc != 0
        assert time.monotonic() - started < 10
    finally:
        setup.stop()


def test_the_set_up_runs_at_the_lowest_priority(bg: ModuleType, tmp_path: Path) -> None:
    """nice counts only within a scheduler autogroup, and a new session is a new one: the
    set-up stays in the runner's session, in a process group of its own."""
    command = "nice; ionice; cat /proc/self/autogroup 2>/dev/null || echo none"
    setup = bg.BackgroundSetup(command, tmp_path, tmp_path)
    try:
        assert setup.join()[0] == 0
    finally:
        setup.stop()
    niceness, io_class, autogroup = (tmp_path / "setup.log").read_text().split("\n")[:3]
    assert niceness == "19"
    assert io_class == "best-effort: prio 7"
    ours = Path("/proc/self/autogroup")
    if ours.exists():
        # The file reads empty where the session has no autogroup of its own (autogroups
        # off, as on CI's runner): the set-up's must then read empty too; a set-up in a
        # new session would get one, and the check would catch it.
        assert autogroup.split()[:1] == ours.read_text().split()[:1]
    assert os.getpgid(0) != setup.proc.pid  # its own group: stop() ends all of it


def test_stop_ends_every_process_of_the_set_up(bg: ModuleType, tmp_path: Path) -> None:
    setup = bg.BackgroundSetup("sleep 60 & sleep 60", tmp_path, tmp_path)
    time.sleep(0.3)
    started = time.monotonic()
    setup.stop()
    assert setup.proc.returncode is not None
    assert time.monotonic() - started < 5


def test_raise_priority_puts_the_set_up_and_what_it_starts_next_at_the_default(
    bg: ModuleType, tmp_path: Path
) -> None:
    """After the unit tier the set-up runs at nice 0 and I/O priority 4: the processes it
    has (the shell) and those it starts from then on (a compiler's next job)."""
    if os.geteuid() != 0:
        pytest.skip("raising a priority needs root (CAP_SYS_NICE)")
    started, release = tmp_path / "started", tmp_path / "release"
    command = f"touch {started}; while [ ! -e {release} ]; do sleep 0.05; done; nice; ionice"
    setup = bg.BackgroundSetup(command, tmp_path, tmp_path)
    try:
        deadline = time.monotonic() + 10
        # Until nice and ionice have set theirs and started the shell.
        while not started.exists():
            assert time.monotonic() < deadline, "the set-up's shell never started"
            time.sleep(0.02)
        assert os.getpriority(os.PRIO_PROCESS, setup.proc.pid) == 19
        setup.raise_priority()
        assert os.getpriority(os.PRIO_PROCESS, setup.proc.pid) == 0
        release.touch()
        assert setup.join()[0] == 0
    finally:
        setup.stop()
    niceness, io_class = (tmp_path / "setup.log").read_text().split("\n")[:2]
    assert niceness == "0"
    assert io_class == "best-effort: prio 4"
