"""`make test`'s set-up, run in the background while the tiers that need none of it run.

It starts at the lowest CPU and I/O priority (nice 19, best-effort class level 7), in the
runner's session and so its scheduler autogroup, where nice counts: on two cores a
compiler that holds a core parks the OpenMP barrier of a tier's torch thread behind it,
which cost the unit tier of a cold run 13 of its 17 minutes. Once the unit tier has
passed it runs at the default priority (`raise_priority`). The set-up takes
what the tiers leave, and a tier waits only for the steps it uses (`wait_for`), read from
the rows hack/timed.sh appends to setup.tsv as each step ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path

LOWEST_PRIORITY = ["nice", "-n", "19", "ionice", "-c", "2", "-n", "7"]
POLL_SECONDS = 2.0


def clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes}:{s:02d}"


def setup_rows(report: Path) -> list[list[str]]:
    """setup.tsv's rows: name, wall seconds, ok|failed (exit N)[, CPU seconds]."""
    path = report / "setup.tsv"
    if not path.exists():
        return []
    return [line.split("\t") for line in path.read_text().splitlines() if line.strip()]


class BackgroundSetup:
    """The set-up command, started now; `wait_for` its steps, `join` the whole of it."""

    def __init__(self, command: str, cwd: Path, report: Path) -> None:
        self.command = command
        self.report = report
        self.log = report / "setup.log"
        self.started = time.monotonic()
        print(f"[test] set-up in the background: {command} (output: {self.log})", flush=True)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*LOWEST_PRIORITY, "/bin/sh", "-c", command],
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                # A process group of its own, so that stop() ends make and every job it
                # started; not a session of its own: a new session is a new scheduler
                # autogroup, which shares the CPU 50/50 with the tiers' whatever its nice.
                process_group=0,
            )
        # When it ended, not when a tier first waited for it; and what it used.
        self.ended: float | None = None
        self.cpu_s = 0.0
        # (exit code, wall seconds, CPU seconds), once joined.
        self.result: tuple[int, float, float] | None = None
        self.waiter = threading.Thread(target=self._wait, daemon=True)
        self.waiter.start()

    def _wait(self) -> None:
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.cpu_s = usage.ru_utime + usage.ru_stime
        self.ended = time.monotonic()
        self.proc.returncode = os.waitstatus_to_exitcode(status)

    def _ended_steps(self) -> dict[str, str]:
        """Each step that has ended, with its status (a step run twice: its last)."""
        return {row[0]: row[2] for row in setup_rows(self.report) if len(row) >= 3}

    def wait_for(self, steps: Iterable[str], tier: str) -> tuple[int, float]:
        """Until each of `steps` has ended ok, a step of them failed, or the set-up ended.
        (0 or 1, seconds waited)"""
        steps = sorted(steps)
        waited = time.monotonic()
        said = False
        while True:
            # The process first: a set-up that ends between the two reads has written its
            # last row before it exits.
            finished = self.proc.returncode is not None
            ended = self._ended_steps()
            failed = [s for s in steps if s in ended and ended[s] != "ok"]
            missing = [s for s in steps if s not in ended]
            if failed or (finished and missing):
                # What else is building is of no use now: stopped, not waited for.
                self.stop()
                rc, _ = self.join()
                why = f"{', '.join(failed)} failed" if failed else f"no {', '.join(missing)} ran"
                print(f"[test] the set-up steps {tier} needs did not end well: {why}")
                return rc or 1, time.monotonic() - waited
            if not missing:
                seconds = time.monotonic() - waited
                rest = "ended" if finished else "goes on beside it"
                print(
                    f"[test] {tier} has its set-up steps ({', '.join(steps)}) after waiting "
                    f"{clock(seconds)}; the rest of the set-up {rest}",
                    flush=True,
                )
                return 0, seconds
            if not said:
                print(f"[test] {tier} waits for the set-up steps {', '.join(missing)} ...")
                said = True
            time.sleep(POLL_SECONDS)

    def wait_quietly(self) -> int:
        """Until the whole set-up has ended, its output left for `join` to print; its exit
        code (for a tier waiting in a thread of its own beside the others)."""
        self.waiter.join()
        rc = self.proc.returncode
        assert rc is not None
        return rc

    def join(self) -> tuple[int, float]:
        """Until the whole set-up has ended; prints its output. (exit code, its wall)"""
        if self.proc.returncode is None:
            print("[test] waiting for the background set-up ...", flush=True)
        self.waiter.join()
        rc = self.proc.returncode
        assert rc is not None
        wall = (self.ended or time.monotonic()) - self.started
        print(
            f"[test] background set-up ended (exit {rc}) after {clock(wall)} "
            f"({clock(self.cpu_s)} of CPU); its output:"
        )
        print(self.log.read_text(errors="replace"), flush=True)
        self.result = (rc, wall, self.cpu_s)
        return rc, wall

    def raise_priority(self) -> None:
        """The set-up at the default CPU and I/O priority from now on (its processes and
        those they start): once no tier runs torch in its own process, nice 19 only makes
        the set-up, and the contention of its overlap with the e2e tier, last longer (a
        cold run: e2e 21:24 beside a set-up at an equal share, 29:46 beside one at nice 19,
        whose set-up then took 43 minutes instead of 30). Raising a priority needs root
        (CAP_SYS_NICE): without it the set-up keeps its own."""
        if self.proc.returncode is not None:
            return
        try:
            os.setpriority(os.PRIO_PGRP, self.proc.pid, 0)
            cpu = "nice 0"
        except OSError as exc:
            cpu = f"nice 19 ({exc.strerror})"
        # Within best-effort a process group's own user may raise it: no root needed.
        io = subprocess.run(
            ["ionice", "-c", "2", "-n", "4", "-P", str(self.proc.pid)],
            check=False,
            capture_output=True,
            text=True,
        )
        disk = "I/O best-effort 4" if io.returncode == 0 else f"I/O as it was ({io.stderr.strip()})"
        print(f"[test] the set-up runs at {cpu}, {disk} from now on", flush=True)

    def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            self.waiter.join()
