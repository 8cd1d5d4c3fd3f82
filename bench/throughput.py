"""Throughput under load: this checkout's `omnipipe serve` beside a baseline commit's (the
code before the throughput work, run from a git worktree in the same run), on the same
tiny checkpoints and the same workloads:

- image: tiny://qwen-image, 64x64, 4 steps, no negative prompt (no CFG);
- speech: tiny://qwen2.5-omni, text in, text and audio out, 16 greedy thinker tokens and
  32 talker codes;
- speech-vllm-talker: the same with the talker on vLLM (the baseline runs `speech`);
- speech-vllm: the same with every stage on vLLM: thinker, talker and code2wav;
- image-colocated, speech-colocated: image and speech with every stage in one process
  (spec.placement; the baseline runs image and speech). bench/colocation.py sets them
  beside this checkout's disaggregated runs instead.

Each level runs `concurrency` closed-loop clients, alone on the machine and again beside
a CPU-busy neighbour process (one core spinning). It reports p50 and p99 latency and
throughput, the median of --repeats runs, and the ratio of each to the baseline's. Servers
run one at a time so that they never share the cores.

    .venv/bin/python bench/throughput.py [--quick] [--baseline REF | --no-baseline]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import multiprocessing
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from _common import REPO, median, percentile, record, table
from _serves import serving, worktree

from tests.e2e.conftest import Served, start_serve

# The commit before the throughput work (issue 25): what "today" means in its targets.
BASELINE_REF = "184d14f"

IMAGE = """apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: tiny-image}
spec:
  model: tiny://qwen-image
  pipeline: qwen-image
"""
SPEECH = """apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: tiny-omni}
spec:
  model: tiny://qwen2.5-omni
  pipeline: qwen2.5-omni
"""
SPEECH_VLLM_TALKER = (
    SPEECH
    + """  stages:
    - {name: talker, engine: vllm}
"""
)
SPEECH_VLLM = (
    SPEECH
    + """  stages:
    - {name: talker, engine: vllm}
    - {name: code2wav, engine: vllm}
"""
)

# spec.placement: every stage in one process, tensors handed over by reference.
COLOCATED = """  placement: {mode: colocated}
"""


def greedy(tokens: int) -> dict[str, Any]:
    return {"temperature": 0, "max_tokens": tokens, "min_tokens": tokens, "seed": 0}


SPEECH_BODY = {"sampling_params_list": {"thinker": greedy(16), "talker": greedy(32)}}


@dataclass(frozen=True)
class Workload:
    name: str
    manifest: str
    model: str
    unit: str
    requests_per_client: int
    min_requests: int
    # The workload the baseline commit runs in its place (it may lack this one's engine).
    anchor: str = ""

    def requests(self, concurrency: int, quick: bool) -> int:
        n = max(self.min_requests, self.requests_per_client * concurrency)
        return concurrency if quick else n  # quick: a request per client, for a smoke run


WORKLOADS = {
    "image": Workload("image", IMAGE, "tiny-image", "img/s", 10, 40),
    "speech": Workload("speech", SPEECH, "tiny-omni", "req/s", 4, 12),
    "speech-vllm-talker": Workload(
        "speech-vllm-talker", SPEECH_VLLM_TALKER, "tiny-omni", "req/s", 4, 12, anchor="speech"
    ),
    "speech-vllm": Workload(
        "speech-vllm", SPEECH_VLLM, "tiny-omni", "req/s", 4, 12, anchor="speech"
    ),
    "image-colocated": Workload(
        "image-colocated", IMAGE + COLOCATED, "tiny-image", "img/s", 10, 40, anchor="image"
    ),
    "speech-colocated": Workload(
        "speech-colocated", SPEECH + COLOCATED, "tiny-omni", "req/s", 4, 12, anchor="speech"
    ),
}


def image_request(client: openai.OpenAI, i: int) -> None:
    r = client.images.generate(
        model="tiny-image",
        prompt=f"a lighthouse at dusk, number {i}",
        size="64x64",
        extra_body={"num_inference_steps": 4, "seed": i},
    )
    if not r.data or not base64.b64decode(r.data[0].b64_json or ""):
        raise openai.OpenAIError("an image response came back without an image")


def speech_request(client: openai.OpenAI, i: int) -> None:
    r = client.chat.completions.create(
        model="tiny-omni",
        messages=[{"role": "user", "content": f"Tell me about the weather in Paris, day {i}."}],
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"},
        extra_body=SPEECH_BODY,
    )
    audio = r.choices[0].message.audio
    if audio is None or not base64.b64decode(audio.data):
        raise openai.OpenAIError("a text+audio chat came back without audio")


CALLS: dict[str, Callable[[openai.OpenAI, int], None]] = {
    "image": image_request,
    "speech": speech_request,
    "speech-vllm-talker": speech_request,
    "speech-vllm": speech_request,
    "image-colocated": image_request,
    "speech-colocated": speech_request,
}


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_neighbour(on: bool) -> Iterator[None]:
    """One process spinning on a core, as another tenant's work would."""
    if not on:
        yield
        return
    proc = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    proc.start()
    try:
        yield
    finally:
        proc.terminate()
        proc.join()


@dataclass(frozen=True)
class Level:
    latencies: list[float]
    wall_s: float
    errors: int

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.wall_s if self.wall_s else 0.0


def drive(call: Callable[[int], None], concurrency: int, total: int, cap_s: float) -> Level:
    """`concurrency` closed-loop clients share `total` requests; none starts after cap_s
    (the slow anchor under a busy neighbour would otherwise take minutes a level)."""
    lock = threading.Lock()
    latencies: list[float] = []
    errors = [0]
    issued = [0]
    started = time.monotonic()

    def client() -> None:
        while True:
            with lock:
                if issued[0] >= total or time.monotonic() - started > cap_s:
                    return
                issued[0] += 1
                i = issued[0]
            sent = time.monotonic()
            try:
                call(i)
            except openai.OpenAIError as exc:
                print(f"      error: {exc}", flush=True)
                with lock:
                    errors[0] += 1
                continue
            with lock:
                latencies.append(time.monotonic() - sent)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Level(latencies, time.monotonic() - started, errors[0])


Row = dict[str, float]


def measure(
    code: Path,
    work: Path,
    wl: Workload,
    levels: tuple[int, ...],
    repeats: int,
    quick: bool,
    cap_s: float,
    server: Served | None = None,
) -> dict[str, Row]:
    """wl's rows from `server` (already started: --quick), or from a serve of its own."""
    if server is None:
        path = work / f"{wl.name}.yaml"
        path.write_text(wl.manifest)
        t0 = time.monotonic()
        server = start_serve(path, timeout=300, code=code)
        print(f"  {wl.name}: serve ready in {time.monotonic() - t0:.0f} s", flush=True)
    out: dict[str, Row] = {}
    try:
        client = openai.OpenAI(
            base_url=server.base_url, api_key="unused", max_retries=0, timeout=300
        )
        call = CALLS[wl.name]
        for i in range(1 if quick else 3):  # first requests pay lazy imports, allocator
            call(client, 10_000 + i)
        for busy in (False, True):
            with busy_neighbour(busy):
                for c in levels:
                    runs = [
                        drive(lambda i: call(client, i), c, wl.requests(c, quick), cap_s)
                        for _ in range(repeats)
                    ]
                    errors = sum(r.errors for r in runs)
                    if errors:
                        raise RuntimeError(f"{wl.name}: {errors} errors at concurrency {c}")
                    lat = [x for r in runs for x in r.latencies]
                    key = f"{c}{'+busy' if busy else ''}"
                    out[key] = {
                        "p50_ms": median([percentile(r.latencies, 0.5) for r in runs]) * 1e3,
                        "p99_ms": percentile(lat, 0.99) * 1e3,
                        "throughput": median([r.throughput for r in runs]),
                        "requests": float(len(lat)),
                    }
                    row = out[key]
                    print(
                        f"    c={key}: p50 {row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms, "
                        f"{row['throughput']:.2f} {wl.unit}",
                        flush=True,
                    )
        client.close()
    finally:
        server.stop()
    return out


TARGETS = """targets (issue 25): image c=4 >= 5x baseline img/s and p50 <= 140 ms, c=16 >= c=4,
c=1 no slower; speech c=1 p50 <= 1/2 baseline, c=4 >= 3x baseline req/s; busy c=1 p50 <=
1.3x alone"""


def report(ours: dict[str, dict[str, Row]], base: dict[str, dict[str, Row]] | None) -> list[str]:
    rows = []
    for wl, levels in ours.items():
        for key, r in levels.items():
            b = base[wl][key] if base else None
            rows.append(
                [
                    wl,
                    key,
                    f"{r['p50_ms']:.0f}",
                    f"{r['p99_ms']:.0f}",
                    f"{r['throughput']:.2f}",
                    f"{b['p50_ms']:.0f}" if b else "-",
                    f"{b['throughput']:.2f}" if b else "-",
                    f"{b['throughput'] and r['throughput'] / b['throughput']:.2f}x" if b else "-",
                    f"{r['p50_ms'] and b['p50_ms'] / r['p50_ms']:.2f}x" if b else "-",
                ]
            )
    print(
        table(
            [
                "workload",
                "c",
                "p50 ms",
                "p99 ms",
                "thrpt",
                "base p50",
                "base thrpt",
                "thrpt ratio",
                "p50 speed-up",
            ],
            rows,
        )
    )
    print(TARGETS)
    summary = []
    for wl, levels in ours.items():
        for key, r in levels.items():
            tag = re.sub(r"\W", "_", f"{wl}_c{key}")
            summary.append(f"{tag}_thrpt={r['throughput']:.2f}")
            if base:
                ratio = r["throughput"] / base[wl][key]["throughput"]
                summary.append(f"{tag}_ratio={ratio:.2f}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, c=1 and 4")
    parser.add_argument("--baseline", default=BASELINE_REF, help="git ref of the anchor")
    parser.add_argument("--no-baseline", action="store_true", help="measure this checkout only")
    parser.add_argument("--workloads", default="image,speech")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cap", type=float, default=15.0, help="seconds a repeat may start requests for"
    )
    args = parser.parse_args()
    levels = (1, 4) if args.quick else (1, 4, 16)
    repeats = 1 if args.quick else args.repeats
    names = [n for n in args.workloads.split(",") if n]
    load = [os.getloadavg()[0]]
    ours: dict[str, dict[str, Row]] = {}
    base: dict[str, dict[str, Row]] | None = None
    with (
        tempfile.TemporaryDirectory() as tmp,
        serving(
            Path(tmp), {n: WORKLOADS[n].manifest for n in names} if args.quick else {}
        ) as servers,
    ):
        work = Path(tmp)
        for name in names:
            print(f"this checkout, {name}:", flush=True)
            wl, server = WORKLOADS[name], servers.take(name)
            ours[name] = measure(REPO, work, wl, levels, repeats, args.quick, args.cap, server)
        if not args.no_baseline:
            base = {}
            anchors = {name: WORKLOADS[name].anchor or name for name in names}
            with worktree(args.baseline) as code:
                for anchor in dict.fromkeys(anchors.values()):
                    print(f"baseline {args.baseline}, {anchor}:", flush=True)
                    base[anchor] = measure(
                        code, work, WORKLOADS[anchor], levels, repeats, args.quick, args.cap
                    )
            base = {name: base[anchor] for name, anchor in anchors.items()}
    load.append(os.getloadavg()[0])
    summary = report(ours, base)
    record(
        "throughput",
        {
            "ours": ours,
            "baseline": base,
            "baseline_ref": None if args.no_baseline else args.baseline,
            "repeats": repeats,
            "load_1m_before_after": load,
        },
        args.quick,
    )
    print("throughput: " + " ".join(summary))


if __name__ == "__main__":
    main()
