"""Drive a URL with wrk (a C load generator, so the client is not the bottleneck) and
parse its latency distribution and throughput."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


@dataclass(frozen=True)
class WrkResult:
    """rps is completions over the run; with deep queues prefer closed_loop_rps."""

    rps: float
    mean_s: float
    p50_s: float
    p99_s: float
    requests: int
    errors: int


def _seconds(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(f"unparsable wrk duration {text!r}")
    return float(m[1]) * UNITS[m[2]]


def parse(output: str) -> WrkResult:
    def grab(pattern: str) -> str:
        m = re.search(pattern, output, re.MULTILINE)
        if not m:
            raise ValueError(f"wrk output lacks {pattern!r}:\n{output}")
        return m[1]

    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", output):
        errors += int(m[1])
    if m := re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    ):
        errors += sum(int(g) for g in m.groups())
    return WrkResult(
        rps=float(grab(r"^Requests/sec:\s+([\d.]+)")),
        mean_s=_seconds(grab(r"^\s+Latency\s+(\S+)")),
        p50_s=_seconds(grab(r"^\s+50%\s+(\S+)")),
        p99_s=_seconds(grab(r"^\s+99%\s+(\S+)")),
        requests=int(grab(r"^\s+(\d+) requests in")),
        errors=errors,
    )


def run(url: str, body: str, connections: int, seconds: float) -> WrkResult:
    script = (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [[{body}]]\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        out = subprocess.run(
            [
                *("wrk", f"-t{min(2, connections)}", f"-c{connections}", f"-d{seconds:g}s"),
                *("--latency", "--timeout", "30s", "-s", f.name, url),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=seconds + 120,
        )
    finally:
        Path(f.name).unlink()
    return parse(out.stdout)


def closed_loop_rps(result: WrkResult, connections: int) -> float:
    """Little's law for a closed loop (each connection sends its next request when the
    last one returns): connections / mean latency. Unlike completions over the run, it
    is not biased by the requests still queued when the run ends."""
    return connections / result.mean_s
