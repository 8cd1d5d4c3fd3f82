"""A tier that runs beside the others, in a thread of its own.

The real-node tier spends most of its wall time waiting (pods starting, Prometheus
scraping, an alert's hold: 0.4 cores busy on average, 12 to 16 minutes), so `make test`
starts it once the unit tier has passed and its set-up has ended, beside the e2e and
integration tiers, instead of after them. Its output goes to a file of its own (two
pytest sessions writing to one terminal interleave line by line) and is printed whole
when it ends.

The lanes stop each other: a main-lane tier that fails cancels the side tier (SIGINT, as
Ctrl-C, so that its fixtures take the node down), and a side tier that fails keeps the
main lane from starting its next tier.
"""

from __future__ import annotations

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
PASSED = 0


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
        # Seconds from the start of the side tier's thread: its set-up wait, its run.
        self.waited = 0.0
        self.started_at: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._shown = False
        self._thread = threading.Thread(target=self._lane, args=(wait, run), daemon=True)
        self._thread.start()

    def _lane(self, wait: Callable[[], int], run: Runner) -> None:
        began = time.monotonic()
        self.setup_rc = wait()
        self.waited = time.monotonic() - began
        if self.setup_rc != PASSED or self._cancelled.is_set():
            return
        self.started_at = time.monotonic()
        say(f"tier {self.tier} starts beside the others (output: {self.log})")
        self.result = run(self._running)
        say(f"tier {self.tier} ended (exit {self.result[0]})")

    def _running(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._proc = proc
            cancelled = self._cancelled.is_set()
        if cancelled:
            proc.send_signal(signal.SIGINT)

    def failed(self) -> bool:
        """Whether it has ended, or could not start, with a failure."""
        if self.setup_rc != PASSED:
            return True
        return self.result is not None and self.result[0] != PASSED

    def cancel(self) -> None:
        """Stop it as Ctrl-C would (its teardowns run), or keep it from starting."""
        with self._lock:
            self._cancelled.set()
            proc = self._proc
        if proc is not None and proc.poll() is None:
            say(f"stopping tier {self.tier}")
            proc.send_signal(signal.SIGINT)

    def join(self) -> None:
        """Until it has ended; then its output, whole, the first time."""
        self._thread.join()
        if self.log.exists() and not self._shown:
            self._shown = True
            say(f"tier {self.tier}'s output:")
            print(self.log.read_text(errors="replace"), flush=True)
