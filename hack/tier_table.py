"""The table at the end of `make test` (hack/test_tiers.py): each set-up step's and tier's
wall time and CPU time, test counts and outcomes, and each tier's slowest items, read
from build/test-report/ (setup.tsv from hack/timed.sh, <tier>.json from
tests/tier_report.py)."""

from __future__ import annotations

import json
from pathlib import Path

from background_setup import clock, setup_rows
from side_tier import PASSED, Result, SideTier

TIERS = ("lint", "unit", "e2e", "integration", "realnode")


def cpu_cell(cpu: float | None, wall: float) -> str:
    """CPU time, and how many of the cores it kept busy on average."""
    return "" if cpu is None else f"{clock(cpu)} ({cpu / max(wall, 1e-9):.1f} cores)"


def setup_table(report: Path, waits: dict[str, float]) -> list[str]:
    lines = ["| set-up step | wall | CPU | result |", "|---|---|---|---|"]
    for row in setup_rows(report):
        name, wall, status = row[0], float(row[1]), row[2]
        cpu = cpu_cell(float(row[3]), wall) if len(row) > 3 else ""
        lines.append(f"| {name} | {clock(wall)} | {cpu} | {status} |")
    lines.append("")
    for tier, waited in waits.items():
        who = "The run's end" if tier == "last" else f"The {tier} tier"
        lines.append(f"{who} waited {clock(waited)} for the set-up.")
    return [*lines, ""] if waits else lines


def table(
    report: Path,
    results: dict[str, Result],
    lint_steps: list[list[object]],
    waits: dict[str, float],
    wall_s: float,
    notes: list[str] | None = None,
) -> str:
    lines = ["", "## make test: where the time went", ""]
    if setup_rows(report):
        lines += setup_table(report, waits)
    if "setup" in results:
        rc, wall, cpu = results["setup"]
        result = "ok" if rc == PASSED else f"FAILED (exit {rc})"
        lines += [
            f"Background set-up: {result}, {clock(wall)}, {cpu_cell(cpu, wall)} of CPU, "
            "beside the tiers.",
            "",
        ]
    lines += [
        "| tier | result | wall | CPU | tests | passed | failed | skipped | xfailed | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    total_tests = 0
    details: list[str] = []
    for tier in TIERS:
        if tier not in results:
            lines.append(f"| {tier} | not run | | | | | | | | |")
            continue
        rc, wall, cpu = results[tier]
        result = "passed" if rc == PASSED else f"FAILED (exit {rc})"
        took = f"{clock(wall)} | {cpu_cell(cpu, wall)}"
        if tier == "lint":
            steps_text = ", ".join(f"{n} {s} s" for n, s in lint_steps)
            lines.append(f"| lint | {result} | {took} | {steps_text} | | | | | |")
            continue
        report_file = report / f"{tier}.json"
        if not report_file.exists():
            lines.append(f"| {tier} | {result} | {took} | no report | | | | | |")
            continue
        counts = json.loads(report_file.read_text())
        o = counts["outcomes"]
        total_tests += counts["collected"]
        workers = counts.get("workers", 0)
        name = f"{tier} ({workers} workers)" if workers else tier
        lines.append(
            f"| {name} | {result} | {took} | {counts['collected']} | {o.get('passed', 0)}"
            f" | {o.get('failed', 0)} | {o.get('skipped', 0)} | {o.get('xfailed', 0)}"
            f" | {o.get('errors', 0)} |"
        )
        details += ["", f"{tier}, ten slowest items (setup + call + teardown):", ""]
        details += ["| s | item |", "|---|---|"]
        details += [f"| {s} | `{nodeid}` |" for nodeid, s in counts["slowest"]]
        if modules := counts.get("modules"):
            details += ["", f"{tier}, ten costliest modules (all their items):", ""]
            details += ["| s | module |", "|---|---|"]
            details += [f"| {s} | `{module}` |" for module, s in modules]
    lines.append(f"| **all tiers** | | **{clock(wall_s)}** | | {total_tests} | | | | | |")
    lines += ["", *notes] if notes else []
    return "\n".join(lines + details) + "\n"


def beside_note(side: SideTier, run_started: float) -> str:
    if side.started_at is None:
        return f"The {side.tier} tier did not start beside the others (hack/side_tier.py)."
    note = (
        f"The {side.tier} tier ran beside the others, from {clock(side.started_at - run_started)}"
        " into the run (hack/side_tier.py)"
    )
    return note + (": stopped when the main lane failed." if side.stopped else ".")
