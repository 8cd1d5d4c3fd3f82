"""A tier that runs beside the others, in a thread of its own.

The real-node tier spends most of its wall time waiting (pods starting, Prometheus
scraping, an alert's hold: 0.4 cores busy on average, 12 to 16 minutes), so `make test`
starts it once the unit tier has passed and its set-up has ended, beside the e2e and
integration tiers, instead of after them. Its output goes to a file of its own (two
pytest sessions writing to one terminal interleave line by line), printed whole when the
main lane joins it: after the main lane's last tier, or when the run stops.

The lanes stop each other: a main-lane tier that fails cancels the side tier (one SIGINT,
as Ctrl-C, so that its fixtures take the node down; SIGKILL to its process group if it
has not ended STOP_GRACE_SECONDS later), and a side tier that fails keeps the main lane
from starting its next tier. Its pytest runs in a process group of its own, so a Ctrl-C
at the terminal reaches it once, through the runner, not twice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

# (exit code, wall seconds, CPU seconds or None where not counted)
Result = tuple[int, float, float | None]
# Runs the tier; calls its argument with the pytest process as soon as it has started.
Runner = Callable[[Callable[["subprocess.Popen[bytes]"], None]], Result]
# pytest's exit code when every test passed (5: nothing collected, a tier that ran no
# test, fails): the runner and the table import it from here.
PASSED = 0
# As long as a main-lane tier is given to end after its SIGINT (hack/test_tiers.py).
STOP_GRACE_SECONDS = 120.0


def say(line: str) -> None:
    """One write, so that a line from this thread is not torn by the main lane's."""
    print(f"[test] {line}\n", end="", flush=True)


class SideTier:
    """`wait()` (the set-up it needs; 0 to go on), then `run`, in a thread started now."""

    def __init__(self, tier: str, wait: Callable[[], int], run: Runner, log: Path) -> None:
        self.tier = tier
        self.log = log
        self.result: Result | None = None
        self.setup_rc = PASSED
        # What broke the lane itself (a log that could not be written, say): a failure.
        self.error: BaseException | None = None
        # Seconds the lane waited for the set-up; when its pytest started.
        self.waited = 0.0
        self.started_at: float | None = None
        self.cancelled = threading.Event()
        # Cancelled while its pytest ran: its exit code is its SIGINT's, not a verdict.
        self.stopped = False
        self._proc: subprocess.Popen[bytes] | None = None
        # Set under the lock once its process has been waited for: from then on its pid
        # may be another process's, and nothing signals it.
        self._reaped = False
        self._interrupted = False
        self._lock = threading.Lock()
        self._shown = False
        self._thread = threading.Thread(target=self._lane, args=(wait, run), daemon=True)
        self._thread.start()

    def _lane(self, wait: Callable[[], int], run: Runner) -> None:
        began = time.monotonic()
        try:
            self.setup_rc = wait()
            self.waited = time.monotonic() - began
            if self.setup_rc != PASSED or self.cancelled.is_set():
                return
            self.started_at = time.monotonic()
            say(f"tier {self.tier} starts beside the others (output: {self.log})")
            self.result = run(self._running)
            say(f"tier {self.tier} ended (exit {self.result[0]})")
        except BaseException as exc:  # whatever it is, the run must not pass because of it
            self.error = exc
            say(f"tier {self.tier} could not run: {exc!r}")
        finally:
            with self._lock:
                self._reaped = True

    def _running(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._proc = proc
        if self.cancelled.is_set():
            self._interrupt()

    def _interrupt(self) -> None:
        with self._lock:
            proc = self._proc if not (self._reaped or self._interrupted) else None
            if proc is not None:
                self._interrupted = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGINT)
        if proc is not None:
            killer = threading.Timer(STOP_GRACE_SECONDS, self._kill, args=(proc.pid,))
            killer.daemon = True
            killer.start()

    def _kill(self, pid: int) -> None:
        with self._lock:
            if self._reaped:
                return
            say(f"tier {self.tier} did not end {STOP_GRACE_SECONDS:.0f} s after its SIGINT")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    def failed(self) -> bool:
        """Whether its own run failed (a set-up that failed is the set-up's failure)."""
        if self.error is not None:
            return True
        return self.result is not None and self.result[0] != PASSED

    def ended(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Stop it as Ctrl-C would (its teardowns run), once; or keep it from starting."""
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        if self.started_at is not None and not self.ended():
            self.stopped = True
            say(f"stopping tier {self.tier}")
        self._interrupt()

    def join(self) -> None:
        """Until it has ended; then its output, whole, the first time."""
        self._thread.join()
        if self.log.exists() and not self._shown:
            self._shown = True
            say(f"tier {self.tier}'s output:")
            print(self.log.read_text(errors="replace"), flush=True)
