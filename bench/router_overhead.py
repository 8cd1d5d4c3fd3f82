"""The latency the router adds and the requests/s it sustains, against a direct call to
the same upstream and against vllm-router (the vLLM project's Rust router, from PyPI) in
front of it. The upstream answers at once (bench/instant_upstream.py), so what is
measured is the router alone. Load comes from wrk at 1, 64 and 512 connections.

    .venv/bin/python bench/router_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from _common import median, record, table
from _procs import running
from _wrk import WrkResult, run

from omnipipe.local.ports import free_port

CONCURRENCY = (1, 64, 512)
BODY = json.dumps(
    {"model": "instant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
)
PIPELINE = """apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: instant}
spec:
  model: instant
  pipeline: custom
  stages:
    - {name: llm, role: thinker, engine: transformers}
"""


def measure(url: str, seconds: float, repeats: int) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    for c in CONCURRENCY:
        runs: list[WrkResult] = [run(url, BODY, c, seconds) for _ in range(repeats)]
        rows[c] = {
            "rps": median([r.rps for r in runs]),
            "p50_ms": median([r.p50_s for r in runs]) * 1e3,
            "p99_ms": median([r.p99_s for r in runs]) * 1e3,
            "errors": sum(r.errors for r in runs),
            "requests": sum(r.requests for r in runs),
        }
        print(f"    c={c}: {rows[c]['rps']:.0f} req/s, p50 {rows[c]['p50_ms']:.2f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("router_overhead needs wrk (Debian package wrk; `make test` installs it)")
    # wrk runs for whole seconds: 1 is its shortest.
    seconds, repeats = (1.0, 1) if args.quick else (10.0, 3)
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        results = run_all(Path(tmp), seconds, repeats)
    report(results, seconds, repeats, args.quick)


def run_all(work: Path, seconds: float, repeats: int) -> dict[str, dict[int, dict[str, float]]]:
    up, vr, op = free_port(), free_port(), free_port()
    (work / "pipeline.yaml").write_text(PIPELINE)
    (work / "replicas.json").write_text(json.dumps({"llm": [f"http://127.0.0.1:{up}"]}))
    results: dict[str, dict[int, dict[str, float]]] = {}
    py = sys.executable
    here = Path(__file__).resolve().parent
    with running(
        [py, str(here / "instant_upstream.py"), str(up)],
        f"http://127.0.0.1:{up}/health",
        work / "upstream.log",
    ):
        print("direct (no router) ...", flush=True)
        results["direct"] = measure(f"http://127.0.0.1:{up}/v1/chat/completions", seconds, repeats)
        vllm_router = [
            str(Path(py).parent / "vllm-router"),
            "--worker-urls",
            f"http://127.0.0.1:{up}",
            "--host",
            "127.0.0.1",
            "--port",
            str(vr),
            "--policy",
            "round_robin",
            "--log-level",
            "warning",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ]
        with running(vllm_router, f"http://127.0.0.1:{vr}/health", work / "vllm-router.log"):
            print("vllm-router ...", flush=True)
            results["vllm-router"] = measure(
                f"http://127.0.0.1:{vr}/v1/chat/completions", seconds, repeats
            )
        omnipipe = [
            py,
            "-m",
            "omnipipe.cli",
            "router",
            "--pipeline",
            str(work / "pipeline.yaml"),
            "--host",
            "127.0.0.1",
            "--port",
            str(op),
            "--replicas-file",
            str(work / "replicas.json"),
        ]
        # Admission control off the path being measured: one replica takes all 512.
        env = {"OMNIPIPE_ROUTER_MAX_QUEUE_PER_REPLICA": "100000"}
        with running(omnipipe, f"http://127.0.0.1:{op}/ready", work / "omnipipe.log", env):
            print("omnipipe router ...", flush=True)
            results["omnipipe"] = measure(
                f"http://127.0.0.1:{op}/v1/chat/completions", seconds, repeats
            )
    return results


def report(
    results: dict[str, dict[int, dict[str, float]]], seconds: float, repeats: int, quick: bool
) -> None:
    rows = []
    for c in CONCURRENCY:
        direct = results["direct"][c]
        for name in ("direct", "vllm-router", "omnipipe"):
            r = results[name][c]
            rows.append(
                [
                    str(c),
                    name,
                    f"{r['rps']:.0f}",
                    f"{r['p50_ms']:.2f}",
                    f"{r['p99_ms']:.2f}",
                    f"{r['p50_ms'] - direct['p50_ms']:+.2f}",
                    f"{r['rps'] / direct['rps']:.2f}",
                    f"{r['rps'] / results['vllm-router'][c]['rps']:.2f}",
                    str(int(r["errors"])),
                ]
            )
    print()
    print(
        table(
            [
                "conc",
                "path",
                "req/s",
                "p50 ms",
                "p99 ms",
                "added p50 ms",
                "rps/direct",
                "rps/vllm-router",
                "errors",
            ],
            rows,
        )
    )
    print(
        f"(medians of {repeats} wrk runs of {seconds:g}s each; client, routers and upstream "
        "share this machine's CPUs)"
    )
    record(
        "router_overhead",
        {n: {str(c): r for c, r in v.items()} for n, v in results.items()},
        quick,
    )
    summary = {}
    for c in CONCURRENCY:
        summary[f"added_p50_ms_c{c}"] = (
            results["omnipipe"][c]["p50_ms"] - results["direct"][c]["p50_ms"]
        )
        summary[f"vllm_router_added_p50_ms_c{c}"] = (
            results["vllm-router"][c]["p50_ms"] - results["direct"][c]["p50_ms"]
        )
        summary[f"rps_c{c}"] = results["omnipipe"][c]["rps"]
        summary[f"rps_vs_vllm_router_c{c}"] = (
            results["omnipipe"][c]["rps"] / results["vllm-router"][c]["rps"]
        )
    print("router_overhead: " + " ".join(f"{k}={v:.3g}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
