"""Shared by the benchmark scripts: machine description, medians, result lines."""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Tests point this elsewhere, so a smoke run never edits the committed results.
RESULTS = Path(
    os.environ.get("OMNIPIPE_BENCH_RESULTS", Path(__file__).resolve().parent / "results")
)
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def without_exit_collection() -> None:
    """Called as a benchmark's last step: the interpreter's collections at exit walk every
    object still alive, and with torch, transformers or vLLM loaded that takes seconds
    (4 s after the engine benchmarks) and frees nothing the process's end would not.
    gc.freeze() leaves them out of those collections."""
    gc.freeze()


def machine() -> dict[str, Any]:
    mem_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def percentile(values: list[float], q: float) -> float:
    """Nearest rank, q from 0 to 1: the smallest value with at least q of the values at
    or below it; nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def at_levels(
    round_at: Callable[[int], tuple[float, float]],
    levels: tuple[int, ...],
    repeats: int,
    rate: str,
    unit: str,
) -> dict[str, dict[str, float]]:
    """An engine's rate at each level of answers at once: round_at(n) runs n answers
    together and gives (seconds, what each answer made); the median of `repeats` rounds,
    after one round that pays the one-time costs (lazy imports, allocator)."""
    round_at(2)
    out = {}
    for level in levels:
        rounds = [round_at(level) for _ in range(repeats)]
        wall = median([seconds for seconds, _ in rounds])
        per_second = level * rounds[0][1] / wall
        out[str(level)] = {"round_s": wall, rate: per_second}
        print(
            f"    {level} at once: {wall * 1e3:.0f} ms a round, {per_second:.1f} {unit}", flush=True
        )
    return out


def finite_or_none(value: Any) -> Any:
    """NaN and infinities as null: Python writes them as bare NaN/Infinity, which is not
    JSON, and strict readers (jq, JavaScript, Go) reject the whole line."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def commit() -> str | None:
    """The code measured: HEAD's short hash, "+changes" when tracked files (other than
    the results) differ from it; None outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if changed else "")


def record(name: str, rows: dict[str, Any], quick: bool) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    line = {
        "name": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "quick": quick,
        "machine": machine(),
        "results": finite_or_none(rows),
    }
    with (RESULTS / f"{name}.jsonl").open("a") as f:
        f.write(json.dumps(line, allow_nan=False) + "\n")


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join(fmt.format(*line).rstrip() for line in lines)
