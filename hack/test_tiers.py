"""`make test`'s runner: the tiers in order of speed, stopping at the first that fails,
then one table of what each took.

    .venv/bin/python hack/test_tiers.py [--tiers lint,unit,e2e,integration,realnode]
        [--setup "make setup"] [--e2e-workers N] [PYTEST_ARGS...]

--setup runs a set-up command in the background from the start, at the lowest CPU and I/O
priority until the unit tier has passed (then the default): lint, unit and e2e need only
the venv, so on a fresh machine they run while the Kubernetes binaries, the node and the
images build, and a compiler never holds a core that the unit tier's OpenMP barrier
waits for. The integration tier waits only for the set-up steps it
uses (NEEDS: the node's own binaries go on building beside it); the real-node tier waits
for the whole set-up, and a failed set-up stops the run.

The real-node tier runs beside the others (BESIDE, hack/side_tier.py): once the unit tier
has passed and the whole set-up has ended, it starts in a thread of its own, its output
in build/test-report/realnode.log (printed whole when the main lane joins it), its serves
on ports of their own. It waits on pods and scrapes most of its time, so beside the e2e and
integration tiers it costs little wall time of its own. A main-lane tier that fails stops
it; a failed real-node tier keeps the main lane from starting its next tier.

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
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from background_setup import BackgroundSetup
from side_tier import PASSED, Result, SideTier, say
from tier_table import TIERS, beside_note, table

from omnipipe.local.ports import PORT_RANGE_ENV, port_range
from omnipipe.worker.threads import budget_environment

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "build" / "test-report"
BIN = Path(sys.executable).parent
# The set-up steps (the Makefile's targets, as hack/timed.sh names them in setup.tsv) a
# tier waits for; None: the whole set-up. The integration tier runs the control plane,
# kwok, helm, the GitOps and Grafana tools and the images (test_container_images builds
# into the image store node-images writes); only the real node needs `node`.
NEEDS: dict[str, frozenset[str] | None] = {
    "integration": frozenset({"k8s-binaries", "gitops-tools", "grafana-tools", "node-images"}),
    "realnode": None,
}
LINT = (
    ("ruff", [str(BIN / "ruff"), "check", "omnipipe", "tests", "bench", "hack"]),
    ("mypy", [str(BIN / "mypy")]),
    ("import contracts", [str(BIN / "lint-imports")]),
)
# The tier after which the background set-up runs at the default priority: the unit
# tier runs torch in its own process, where nice 19 keeps a compiler from the cores its
# OpenMP barriers wait on; the tiers after it start workers of their own thread budgets.
NICE_UNTIL = "unit"
# A tier that runs beside the others once the tier named has passed and its set-up has
# ended (hack/side_tier.py): the real node waits on pods and scrapes most of its time.
BESIDE = {"realnode": "unit"}


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


def reap(proc: subprocess.Popen[bytes]) -> float:
    """Wait for the process; the CPU seconds (user + system) it and the children it
    waited for used. The exit code goes where Popen keeps it."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


# The tiers whose tests run torch in the pytest process itself (tiny models, stage by
# stage), and the variables that give it one thread while the set-up still builds: two
# OpenMP threads on two cores beside a compiler wait at every barrier for the one the
# compiler holds the core of, and nice does not stop it (a cold run's code2wav unit
# tests took 167 s at nice 19, 3 s alone). Workers started by a tier are sized by their
# own --threads, and the e2e tier's serves must see the environment a user's would.
ONE_THREAD_WHILE_SETUP = frozenset({"unit"})


def run_tier(
    tier: str,
    pytest_args: list[str],
    setup_running: bool = False,
    ports: str | None = None,
    output: Path | None = None,
    started: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> tuple[int, float, float]:
    """(exit code, wall seconds, CPU seconds). `ports`: the OMNIPIPE_PORT_RANGE its serves
    and clusters pick from; `output`: a file for its output instead of the terminal, and a
    process group of its own (a tier beside the others: the runner alone signals it);
    `started`: called with the pytest process once it runs."""
    env = {**os.environ, "OMNIPIPE_TEST_TIER": tier, "OMNIPIPE_TEST_REPORT": str(REPORT)}
    if ports is not None:
        env[PORT_RANGE_ENV] = ports
    if setup_running and tier in ONE_THREAD_WHILE_SETUP:
        print(f"[test] tier {tier}: torch on one thread while the set-up builds", flush=True)
        # The variables a worker's thread budget sets (OpenMP, MKL, OpenBLAS, Rayon).
        env.update(budget_environment(1))
    say(f"tier {tier}: pytest tests/{tier} {' '.join(pytest_args)}")
    began = time.monotonic()
    cmd = [str(BIN / "pytest"), f"tests/{tier}", *pytest_args]
    with contextlib.ExitStack() as files:
        out = files.enter_context(output.open("wb")) if output is not None else None
        err = subprocess.STDOUT if out is not None else None
        group = 0 if out is not None else None
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, process_group=group)
    if started is not None:
        started(proc)
    try:
        cpu = reap(proc)
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
    return proc.returncode, time.monotonic() - began, cpu


def join_setup(
    setup: BackgroundSetup, tier: str, needs: frozenset[str] | None, waits: dict[str, float]
) -> int:
    """Wait for `needs` of the set-up (None: all of it) before `tier`; 0 to go on."""
    waited = time.monotonic()
    if needs is None:
        rc, _ = setup.join()
    elif needs:
        rc, _ = setup.wait_for(needs, tier)
    else:
        return PASSED
    waits[tier] = time.monotonic() - waited
    return rc


# Fewer ports than this to share, and the lanes pick from all of them (free_port then
# falls back to the kernel's pick, as it does without a range).
MIN_PORTS_TO_SPLIT = 2000


def port_ranges() -> tuple[str | None, str | None]:
    """Two halves of the ports free_port picks from, for the tiers that run while the side
    tier does: each lane's serves pick ports free and bind them seconds later, so each
    lane gets ports of its own. (None, None) where there are too few to halve."""
    low, high = port_range()
    if high - low + 1 < MIN_PORTS_TO_SPLIT:
        return None, None
    middle = (low + high) // 2
    return f"{low}-{middle}", f"{middle + 1}-{high}"


def setup_ended(setup: BackgroundSetup) -> bool:
    return setup.proc.returncode is not None


def side_failed(sides: list[SideTier], tier: str) -> bool:
    """Whether a side tier's own run has failed; said, with `tier` not to be run."""
    if failed := [side.tier for side in sides if side.failed()]:
        print(f"[test] tier {', '.join(failed)} failed: {tier} and after not run", flush=True)
        return True
    return False


def side_rc(side: SideTier) -> int:
    """What a joined side tier makes of the run: 0, its exit code or its set-up's."""
    if side.setup_rc != PASSED:
        print(f"[test] the set-up failed (exit {side.setup_rc}): {side.tier} not run", flush=True)
        return side.setup_rc
    if side.error is not None:
        return 1
    return side.result[0] if side.result is not None else PASSED


def start_side_tier(
    tier: str, setup: BackgroundSetup | None, pytest_args: list[str], ports: str | None
) -> SideTier:
    def wait() -> int:
        if setup is None:
            return PASSED
        say(f"{tier} waits for the whole set-up, beside the other tiers")
        return setup.wait_quietly()

    def run(started: Callable[[subprocess.Popen[bytes]], None]) -> Result:
        return run_tier(
            tier, pytest_args, ports=ports, output=REPORT / f"{tier}.log", started=started
        )

    return SideTier(tier, wait, run, REPORT / f"{tier}.log")


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
    # A runner started in the background (`nohup ... &`, some CI agents) inherits SIGINT
    # ignored, and so would every tier's pytest: the SIGINT that stops a tier (its
    # teardowns take the node and the serves down) would do nothing. A handler is reset
    # to the default at exec, where an ignored signal stays ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tiers = [t for t in args.tiers.split(",") if t]
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        parser.error(f"unknown tiers {unknown}; known: {', '.join(TIERS)}")
    # A tier goes beside the others only where the tier it follows runs first here.
    beside = {t: after for t, after in BESIDE.items() if t in tiers and after in tiers}
    main_ports, side_ports = port_ranges() if beside else (None, None)
    started = time.monotonic()
    REPORT.mkdir(parents=True, exist_ok=True)
    for tier in TIERS:
        (REPORT / f"{tier}.json").unlink(missing_ok=True)
        (REPORT / f"{tier}.log").unlink(missing_ok=True)
    results: dict[str, Result] = {}
    waits: dict[str, float] = {}
    lint_steps: list[list[object]] = []
    rc = PASSED
    setup = BackgroundSetup(args.setup, REPO, REPORT) if args.setup else None
    sides: list[SideTier] = []
    try:
        for tier in [t for t in tiers if t not in beside]:
            if side_failed(sides, tier):
                break
            needs = NEEDS.get(tier, frozenset())
            if setup is not None and (rc := join_setup(setup, tier, needs, waits)) != PASSED:
                print(f"[test] the set-up failed (exit {rc}): {tier} and after not run")
                break
            if side_failed(sides, tier):  # while it waited for the set-up
                break
            if tier == "lint":
                rc, wall, lint_steps = run_lint()
                results[tier] = (rc, wall, None)
            else:
                running = setup is not None and setup.proc.returncode is None
                flags = [*tier_args(tier, args.e2e_workers), *pytest_args]
                # Ports of their own only while a side tier may run beside them.
                ports = main_ports if sides else None
                results[tier] = run_tier(tier, flags, setup_running=running, ports=ports)
                rc = results[tier][0]
            if rc != PASSED:
                print(
                    f"[test] tier {tier} failed (exit {rc}): the tiers after it were not run",
                    flush=True,
                )
                for side in sides:
                    side.cancel()
                break
            if tier == NICE_UNTIL and setup is not None:
                setup.raise_priority()
            for side_tier, after in beside.items():
                if after == tier:
                    sides.append(start_side_tier(side_tier, setup, pytest_args, side_ports))
        # A main lane that failed does not wait for a side tier that still waits for the
        # set-up: the finally below stops the set-up first.
        for side in sides if rc == PASSED else []:
            side.join()
            rc = rc or side_rc(side)
        if setup is not None and setup.result is None and (rc == PASSED or setup_ended(setup)):
            # The tiers asked for none or part of it: the set-up still ends, as it was asked
            # to; or a side tier waited for it whole: its output and its row in the table.
            joined = join_setup(setup, "last", None, waits)
            rc = rc or joined
    finally:
        for side in sides:
            side.cancel()
        if setup is not None:
            setup.stop()
            if setup.result is not None:
                results["setup"] = setup.result
        for side in sides:
            side.join()
            if side.result is not None:
                results[side.tier] = side.result
                waits[side.tier] = side.waited
    notes = [beside_note(side, started) for side in sides]
    text = table(REPORT, results, lint_steps, waits, time.monotonic() - started, notes)
    (REPORT / "table.md").write_text(text)
    print(text, flush=True)
    return 1 if rc != PASSED else 0


if __name__ == "__main__":
    sys.exit(main())
