"""`make test`'s runner: the tiers in order of speed, stopping at the first that fails,
then one table of what each took.

    .venv/bin/python hack/test_tiers.py [--tiers lint,unit,e2e,integration,realnode]
        [--setup "make setup"] [--e2e-workers N] [PYTEST_ARGS...]

--setup runs a set-up command in the background from the start: lint, unit and e2e need
only the venv, so on a fresh machine they run while the Kubernetes binaries, the node and
the images build; the integration and real-node tiers wait for it (its output is printed
when it ends, and a failed set-up stops the run there).

--e2e-workers N runs the e2e tier's modules on N pytest-xdist workers (`-n N --dist
loadgroup`; tests/e2e/conftest.py keeps the modules that share a serve on one worker); 0,
the default here, runs it in one process. The other tiers run in one process.

Each pytest tier runs in its own process with OMNIPIPE_TEST_TIER and OMNIPIPE_TEST_REPORT
set, and tests/tier_report.py writes what it saw to build/test-report/<tier>.json. The
set-up steps (hack/timed.sh) write build/test-report/setup.tsv. The table printed at the
end reads both, so a failed run shows how far it got and what the time went on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "build" / "test-report"
BIN = Path(sys.executable).parent
TIERS = ("lint", "unit", "e2e", "integration", "realnode")
NEED_SETUP = frozenset({"integration", "realnode"})
LINT = (
    ("ruff", [str(BIN / "ruff"), "check", "omnipipe", "tests", "bench", "hack"]),
    ("mypy", [str(BIN / "mypy")]),
    ("import contracts", [str(BIN / "lint-imports")]),
)
# pytest's exit codes: 0 all passed, 5 nothing collected (a tier that ran no test fails).
PASSED = 0


def clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes}:{s:02d}"


# mypy's cache, shared by every checkout: a fresh clone re-checks what changed, not the
# whole tree and its dependencies' stubs (mypy takes a cached module whose path or mtime
# differ when its hash is the same).
MYPY_CACHE = Path(os.environ.get("MYPY_CACHE_DIR", Path.home() / ".cache/omnipipe/mypy"))


def run_lint() -> tuple[int, float, list[list[object]]]:
    started = time.monotonic()
    steps: list[list[object]] = []
    env = {**os.environ, "MYPY_CACHE_DIR": str(MYPY_CACHE)}
    for name, cmd in LINT:
        t = time.monotonic()
        print(f"[test] lint: {name}", flush=True)
        rc = subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode
        steps.append([name, round(time.monotonic() - t, 1)])
        if rc != PASSED:
            return rc, time.monotonic() - started, steps
    return PASSED, time.monotonic() - started, steps


def tier_args(tier: str, e2e_workers: int) -> list[str]:
    """The tier's own pytest flags, before PYTEST_ARGS (which may override them)."""
    if tier == "e2e" and e2e_workers > 0:
        return ["-n", str(e2e_workers), "--dist", "loadgroup"]
    return []


def run_tier(tier: str, pytest_args: list[str]) -> tuple[int, float]:
    env = {**os.environ, "OMNIPIPE_TEST_TIER": tier, "OMNIPIPE_TEST_REPORT": str(REPORT)}
    print(f"[test] tier {tier}: pytest tests/{tier} {' '.join(pytest_args)}", flush=True)
    started = time.monotonic()
    cmd = [str(BIN / "pytest"), f"tests/{tier}", *pytest_args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    try:
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            # The runner was stopped: so is its tier, as by Ctrl-C, so that its fixtures'
            # teardowns stop the control plane, the node and the serves it started.
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return rc, time.monotonic() - started


class BackgroundSetup:
    """The set-up command, started now and joined before the first tier that needs it."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.log = REPORT / "setup.log"
        self.started = time.monotonic()
        print(f"[test] set-up in the background: {command} (output: {self.log})", flush=True)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                command,
                shell=True,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # stop() ends make and every job it started
            )
        # When it ended, not when a tier first waited for it.
        self.ended: float | None = None
        self.waiter = threading.Thread(target=self._wait, daemon=True)
        self.waiter.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()

    def join(self) -> tuple[int, float]:
        if self.proc.poll() is None:
            print("[test] waiting for the background set-up ...", flush=True)
        self.waiter.join()
        rc = self.proc.returncode
        wall = (self.ended or time.monotonic()) - self.started
        print(f"[test] background set-up ended (exit {rc}) after {clock(wall)}; its output:")
        print(self.log.read_text(errors="replace"), flush=True)
        return rc, wall

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait()


def setup_rows() -> list[list[str]]:
    path = REPORT / "setup.tsv"
    if not path.exists():
        return []
    return [line.split("\t") for line in path.read_text().splitlines() if line.strip()]


def table(
    results: dict[str, tuple[int, float]], lint_steps: list[list[object]], wall_s: float
) -> str:
    lines = ["", "## make test: where the time went", ""]
    steps = setup_rows()
    if steps:
        lines += ["| set-up step | wall | result |", "|---|---|---|"]
        lines += [f"| {name} | {clock(float(s))} | {status} |" for name, s, status in steps]
        lines.append("")
    if "setup" in results:
        rc, wall = results["setup"]
        result = "ok" if rc == PASSED else f"FAILED (exit {rc})"
        lines += [f"Background set-up: {result}, {clock(wall)} beside the tiers before it.", ""]
    lines += [
        "| tier | result | wall | tests | passed | failed | skipped | xfailed | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    total_tests = 0
    details: list[str] = []
    for tier in TIERS:
        if tier not in results:
            lines.append(f"| {tier} | not run | | | | | | | |")
            continue
        rc, wall = results[tier]
        result = "passed" if rc == PASSED else f"FAILED (exit {rc})"
        if tier == "lint":
            steps_text = ", ".join(f"{n} {s} s" for n, s in lint_steps)
            lines.append(f"| lint | {result} | {clock(wall)} | {steps_text} | | | | | |")
            continue
        report_file = REPORT / f"{tier}.json"
        if not report_file.exists():
            lines.append(f"| {tier} | {result} | {clock(wall)} | no report | | | | | |")
            continue
        report = json.loads(report_file.read_text())
        o = report["outcomes"]
        total_tests += report["collected"]
        workers = report.get("workers", 0)
        name = f"{tier} ({workers} workers)" if workers else tier
        lines.append(
            f"| {name} | {result} | {clock(wall)} | {report['collected']} | {o.get('passed', 0)}"
            f" | {o.get('failed', 0)} | {o.get('skipped', 0)} | {o.get('xfailed', 0)}"
            f" | {o.get('errors', 0)} |"
        )
        details += ["", f"{tier}, ten slowest items (setup + call + teardown):", ""]
        details += ["| s | item |", "|---|---|"]
        details += [f"| {s} | `{nodeid}` |" for nodeid, s in report["slowest"]]
    lines.append(f"| **all tiers** | | **{clock(wall_s)}** | {total_tests} | | | | | |")
    return "\n".join(lines + details) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--tiers", default=",".join(TIERS), help="comma-separated, in order")
    parser.add_argument("--setup", help="a shell command to run in the background (see above)")
    parser.add_argument(
        "--e2e-workers", type=int, default=0, help="pytest-xdist workers for e2e (see above)"
    )
    args, pytest_args = parser.parse_known_args()
    # A SIGTERM unwinds like Ctrl-C, so the tier and the background set-up stop too.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        parser.error(f"unknown tiers {unknown}; known: {', '.join(TIERS)}")
    started = time.monotonic()
    REPORT.mkdir(parents=True, exist_ok=True)
    for tier in TIERS:
        (REPORT / f"{tier}.json").unlink(missing_ok=True)
    results: dict[str, tuple[int, float]] = {}
    lint_steps: list[list[object]] = []
    rc = PASSED
    setup = BackgroundSetup(args.setup) if args.setup else None
    try:
        for tier in tiers:
            if setup is not None and tier in NEED_SETUP and "setup" not in results:
                results["setup"] = setup.join()
                rc = results["setup"][0]
                if rc != PASSED:
                    print(f"[test] the set-up failed (exit {rc}): {tier} and after not run")
                    break
            if tier == "lint":
                rc, wall, lint_steps = run_lint()
            else:
                rc, wall = run_tier(tier, [*tier_args(tier, args.e2e_workers), *pytest_args])
            results[tier] = (rc, wall)
            if rc != PASSED:
                print(f"[test] tier {tier} failed (exit {rc}): the tiers after it were not run")
                break
    finally:
        if setup is not None:
            setup.stop()
    text = table(results, lint_steps, time.monotonic() - started)
    (REPORT / "table.md").write_text(text)
    print(text, flush=True)
    return 1 if rc != PASSED else 0


if __name__ == "__main__":
    sys.exit(main())
