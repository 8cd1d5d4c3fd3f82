"""Throughput of a 3-stage pipeline with balanced stage times, at concurrency 1 to 16,
against the ideal 1/max(stage time) and against a monolithic server that runs the three
stages one after another in a single process.

The stages are real omnipipe workers and router (TCP hand-offs of 64 KiB between them)
with a fake engine that sleeps for the stage time (bench/_sleep_worker.py): three
CPU-bound stages could not overlap on a machine with fewer cores than stages, and it is
the pipelining that is measured here, not the compute.

    .venv/bin/python bench/pipelining.py [--quick] [--stage-ms 50]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import median, record, table
from _procs import running, wait_http
from _wrk import closed_loop_rps, run

from omnipipe.local.ports import free_port

HERE = Path(__file__).resolve().parent
STAGES = ("s1", "s2", "s3")
BODY = json.dumps({"model": "pipe", "prompt": "x", "size": "64x64"})


def manifest(seconds: float, model: Path) -> str:
    """`model`: any existing directory; the sleeping stages load nothing from it (a name
    that is neither a directory nor a Hub id is refused before a stage loads)."""
    args = f"engineArgs: {{seconds: {seconds}, nbytes: 65536}}"
    return f"""apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {{name: pipe}}
spec:
  model: {model}
  pipeline: custom
  transfer: {{backend: tcp}}
  stages:
    - {{name: s1, role: text-encoder, engine: transformers, {args}}}
    - {{name: s2, role: denoiser, engine: diffusers, inputs: [s1], {args}}}
    - {{name: s3, role: vae-decoder, engine: diffusers, inputs: [s2], {args}}}
"""


def measure(url: str, levels: list[int], seconds: float, repeats: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for c in levels:
        runs = [run(url, BODY, c, seconds) for _ in range(repeats)]
        if any(r.errors for r in runs):
            raise RuntimeError(f"{url} answered errors at concurrency {c}")
        out[c] = median([closed_loop_rps(r, c) for r in runs])
        print(f"    c={c}: {out[c]:.2f} req/s", flush=True)
    return out


def run_all(
    work: Path, stage_s: float, levels: list[int], seconds: float, repeats: int, quick: bool
) -> dict[str, dict[int, float]]:
    py = sys.executable
    (work / "pipe.yaml").write_text(manifest(stage_s, work))
    results: dict[str, dict[int, float]] = {}
    mono = free_port()
    with contextlib.ExitStack() as stack:
        # --quick starts omnipipe's four processes together, before the monolith is
        # measured (its stages sleep: it leaves the cores to their imports), and then
        # waits for them.
        started = start_omnipipe(stack, work, quick) if quick else None
        with running(
            [py, str(HERE / "_monolith.py"), str(mono), str(stage_s), str(len(STAGES))],
            f"http://127.0.0.1:{mono}/health",
            work / "monolith.log",
        ):
            print("monolithic (one process, stages in sequence) ...", flush=True)
            results["monolithic"] = measure(
                f"http://127.0.0.1:{mono}/v1/images/generations", levels, seconds, repeats
            )
        router, starting = started or start_omnipipe(stack, work, quick)
        for url, proc in starting:
            wait_http(url, proc=proc)
        print("omnipipe (3 stage workers + router) ...", flush=True)
        results["omnipipe"] = measure(f"{router}/v1/images/generations", levels, seconds, repeats)
    return results


def start_omnipipe(
    stack: contextlib.ExitStack, work: Path, quick: bool
) -> tuple[str, list[tuple[str, subprocess.Popen[bytes]]]]:
    """The three sleeping stages' workers and the router, in `stack`: the router's URL,
    and each process with the URL that answers once it is ready. quick: the four start
    together, for the caller to wait for; else each is waited for before the next."""
    py = sys.executable
    starting: list[tuple[str, subprocess.Popen[bytes]]] = []
    replicas = {}
    for stage in STAGES:
        control, transfer = free_port(), free_port()
        proc = stack.enter_context(
            running(
                [
                    py,
                    str(HERE / "_sleep_worker.py"),
                    "worker",
                    "--pipeline",
                    str(work / "pipe.yaml"),
                    "--stage",
                    stage,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(control),
                    "--transfer-port",
                    str(transfer),
                    "--advertise-host",
                    "127.0.0.1",
                ],
                f"http://127.0.0.1:{control}/ready",
                work / f"{stage}.log",
                wait=not quick,
            )
        )
        starting.append((f"http://127.0.0.1:{control}/ready", proc))
        replicas[stage] = [f"http://127.0.0.1:{control}"]
    (work / "replicas.json").write_text(json.dumps(replicas))
    router = free_port()
    proc = stack.enter_context(
        running(
            [
                py,
                "-m",
                "omnipipe.cli",
                "router",
                "--pipeline",
                str(work / "pipe.yaml"),
                "--host",
                "127.0.0.1",
                "--port",
                str(router),
                "--replicas-file",
                str(work / "replicas.json"),
            ],
            f"http://127.0.0.1:{router}/ready",
            work / "router.log",
            wait=not quick,
        )
    )
    starting.append((f"http://127.0.0.1:{router}/ready", proc))
    return f"http://127.0.0.1:{router}", starting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer levels, short runs")
    parser.add_argument("--stage-ms", type=float, default=50.0, help="time of each stage")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("pipelining needs wrk (Debian package wrk; `make test` installs it)")
    levels = [1, 4, 16] if args.quick else [1, 2, 4, 8, 16]
    # wrk runs for whole seconds: 1 is its shortest.
    seconds, repeats = (1.0, 1) if args.quick else (8.0, 3)
    stage_s = args.stage_ms / 1000
    with tempfile.TemporaryDirectory(prefix="pipelining-") as tmp:
        results = run_all(Path(tmp), stage_s, levels, seconds, repeats, args.quick)
    ideal, serial = 1 / stage_s, 1 / (stage_s * len(STAGES))
    rows = [
        [
            str(c),
            f"{results['omnipipe'][c]:.2f}",
            f"{results['monolithic'][c]:.2f}",
            f"{ideal:.2f}",
            f"{results['omnipipe'][c] / ideal:.2f}",
            f"{results['omnipipe'][c] / results['monolithic'][c]:.2f}",
        ]
        for c in levels
    ]
    print()
    print(
        table(
            [
                "conc",
                "omnipipe req/s",
                "monolithic req/s",
                "ideal req/s",
                "of ideal",
                "vs monolithic",
            ],
            rows,
        )
    )
    print(
        f"(stage time {args.stage_ms:g} ms x {len(STAGES)}; "
        f"ideal = 1/max(stage) = {ideal:.1f} req/s, "
        f"monolithic bound = 1/sum = {serial:.1f} req/s; "
        f"medians of {repeats} runs of {seconds:g}s;\n"
        " req/s = connections / mean latency (Little's law), "
        "unbiased by requests queued at the end)"
    )
    record(
        "pipelining",
        {
            "stage_ms": args.stage_ms,
            "ideal_rps": ideal,
            **{k: {str(c): v for c, v in r.items()} for k, r in results.items()},
        },
        args.quick,
    )
    top = levels[-1]
    summary = {
        f"rps_c{top}": results["omnipipe"][top],
        f"of_ideal_c{top}": results["omnipipe"][top] / ideal,
        f"vs_monolithic_c{top}": results["omnipipe"][top] / results["monolithic"][top],
        "rps_c1": results["omnipipe"][1],
        "monolithic_rps_c1": results["monolithic"][1],
    }
    print("pipelining: " + " ".join(f"{k}={v:.3g}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
