"""Co-location against disaggregation: the same tiny pipelines under this checkout's
`omnipipe serve`, once with a process per stage and once with every stage in one process
(spec.placement: colocated), in the same run:

- image: tiny://qwen-image, 64x64, 4 steps (bench/throughput.py's image workload);
- speech: tiny://qwen2.5-omni, 16 greedy thinker tokens and 32 talker codes.

Each level runs `concurrency` closed-loop clients, alone on the machine and beside a
CPU-busy neighbour, and reports p50, p99 and throughput (medians of --repeats) and the
colocated run's ratios to the disaggregated one's. The servers run one at a time.

    .venv/bin/python bench/colocation.py [--quick] [--workloads image,speech]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from _common import REPO, record, table
from _serves import serving
from throughput import WORKLOADS, Row, measure


def report(pairs: dict[str, tuple[dict[str, Row], dict[str, Row]]]) -> list[str]:
    rows, summary = [], []
    for name, (alone, together) in pairs.items():
        for key, a in alone.items():
            t = together[key]
            speed = t["throughput"] / a["throughput"] if a["throughput"] else 0.0
            rows.append(
                [
                    name,
                    key,
                    f"{a['p50_ms']:.0f}",
                    f"{t['p50_ms']:.0f}",
                    f"{a['throughput']:.2f}",
                    f"{t['throughput']:.2f}",
                    f"{speed:.2f}x",
                    f"{t['p50_ms'] and a['p50_ms'] / t['p50_ms']:.2f}x",
                ]
            )
            summary.append(f"{name}_c{key.replace('+', '_')}_ratio={speed:.2f}")
    headers = ["workload", "c", "p50 apart", "p50 together", "thrpt apart", "thrpt together"]
    print(table([*headers, "thrpt ratio", "p50 speed-up"], rows))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, c=1 and 4")
    parser.add_argument("--workloads", default="image,speech")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cap", type=float, default=15.0, help="seconds a repeat may start requests for"
    )
    args = parser.parse_args()
    levels = (1, 4) if args.quick else (1, 4, 16)
    repeats = 1 if args.quick else args.repeats
    load = [os.getloadavg()[0]]
    pairs: dict[str, tuple[dict[str, Row], dict[str, Row]]] = {}
    names = [n for n in args.workloads.split(",") if n]
    placements = [p for name in names for p in (name, f"{name}-colocated")]
    texts = {p: WORKLOADS[p].manifest for p in placements} if args.quick else {}
    with tempfile.TemporaryDirectory() as tmp, serving(Path(tmp), texts) as servers:
        work = Path(tmp)
        for name in names:
            runs = []
            for placement in (name, f"{name}-colocated"):
                print(f"{placement}:", flush=True)
                wl, server = WORKLOADS[placement], servers.take(placement)
                runs.append(measure(REPO, work, wl, levels, repeats, args.quick, args.cap, server))
            pairs[name] = (runs[0], runs[1])
    load.append(os.getloadavg()[0])
    summary = report(pairs)
    record(
        "colocation",
        {
            "pairs": {n: {"disaggregated": a, "colocated": t} for n, (a, t) in pairs.items()},
            "repeats": repeats,
            "load_1m_before_after": load,
        },
        args.quick,
    )
    print("colocation: " + " ".join(summary))


if __name__ == "__main__":
    main()
