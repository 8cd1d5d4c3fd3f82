"""Soak: N minutes of mixed requests (images, text chats, text+audio chats, speech) at a
bounded concurrency against `omnipipe serve` of two tiny pipelines, one image
(tiny://qwen-image) and one omni (tiny://qwen2.5-omni, thinker on vLLM); reports errors by
status, p50/p99 latency per kind, and every process's RSS and open file descriptors at
the start and at the end.

Every request of a kind does the same work (min tokens = max tokens), so the start and
end figures compare like with like. Each client thread sends the kinds in turn until the
time is up; no request starts after it. The start figures are taken after one warm-up
request of each kind (first requests pay one-time costs: lazy imports, the allocator's
first pools), the end figures once the last request is answered.

    .venv/bin/python bench/soak.py [--minutes 5] [--concurrency 4] [--quick]
"""

from __future__ import annotations

import argparse
import base64
import math
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import openai
from _common import median, percentile, record, table
from _serves import Together

from tests.e2e.conftest import Served, start_serve

# Both pipelines as they come, named as the other benchmarks name them, so that a smoke
# run lends this benchmark the serves they share (bench/_serves.py); the omni requests
# carry their sampling (16 thinker tokens, 50 talker codes) instead of the pipeline.
IMAGE = "tiny-image"
OMNI = "tiny-omni"
KIND = {IMAGE: "image", OMNI: "omni"}
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
MANIFESTS = {
    IMAGE: f"""apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {{name: {IMAGE}}}
spec:
  model: tiny://qwen-image
  pipeline: qwen-image
""",
    OMNI: f"""apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {{name: {OMNI}}}
spec:
  model: tiny://qwen2.5-omni
  pipeline: qwen2.5-omni
""",
}
THINKER = {"max_tokens": 16, "min_tokens": 16}
TALKER = {"max_tokens": 50, "min_tokens": 50}
TEXT_ONLY = {"sampling_params_list": {"thinker": THINKER}}
WITH_AUDIO = {"sampling_params_list": {"thinker": THINKER, "talker": TALKER}}
KINDS = ("image", "text_chat", "audio_chat", "speech")
CLIENT_TIMEOUT_S = 120.0


def image(c: openai.OpenAI) -> None:
    r = c.images.generate(
        model=IMAGE, prompt="a lighthouse", size="64x64", extra_body={"num_inference_steps": 4}
    )
    if not r.data or not r.data[0].b64_json:
        raise ValueError("an image response without an image")


def text_chat(c: openai.OpenAI) -> None:
    r = c.chat.completions.create(model=OMNI, messages=MESSAGES, extra_body=TEXT_ONLY)
    if r.usage is None or not r.usage.completion_tokens:
        raise ValueError("a chat completion without tokens")


def audio_chat(c: openai.OpenAI) -> None:
    r = c.chat.completions.create(
        model=OMNI,
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"},
        extra_body=WITH_AUDIO,
    )
    audio = r.choices[0].message.audio
    if audio is None or not base64.b64decode(audio.data):
        raise ValueError("a text+audio chat without audio")


def speech(c: openai.OpenAI) -> None:
    r = c.audio.speech.create(
        model=OMNI, input="The sea is calm.", voice="Chelsie", extra_body=WITH_AUDIO
    )
    if len(r.content) <= 44:  # a WAV header and nothing else
        raise ValueError("speech without samples")


CALLS: dict[str, Callable[[openai.OpenAI], None]] = {
    "image": image,
    "text_chat": text_chat,
    "audio_chat": audio_chat,
    "speech": speech,
}


@dataclass
class Outcomes:
    """Per kind: latencies of the answered requests, and errors by status."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    errors: dict[str, Counter[str]] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    # The first message of each kind's each error status.
    examples: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, seconds: float, error: Exception | None) -> None:
        with self.lock:
            if error is None:
                self.latencies[kind].append(seconds)
            else:
                status = error_status(error)
                self.errors[kind][status] += 1
                self.examples.setdefault(f"{kind} {status}", str(error)[:300])


def error_status(exc: Exception) -> str:
    """How an error is counted: the HTTP status, or what went wrong without one."""
    if isinstance(exc, openai.APIStatusError):
        return str(exc.status_code)
    if isinstance(exc, openai.APITimeoutError):
        return "client_timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, openai.APIError):
        return "stream_error"
    return "bad_response"


def soak(
    clients: dict[str, openai.OpenAI], concurrency: int, seconds: float, outcomes: Outcomes
) -> None:
    deadline = time.monotonic() + seconds

    def worker(offset: int) -> None:
        for i in range(offset, 1_000_000):
            if time.monotonic() >= deadline:
                return
            kind = KINDS[i % len(KINDS)]
            started = time.monotonic()
            try:
                CALLS[kind](clients[kind])
            except (openai.OpenAIError, ValueError) as exc:
                outcomes.add(kind, time.monotonic() - started, exc)
            else:
                outcomes.add(kind, time.monotonic() - started, None)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@dataclass(frozen=True)
class Usage:
    rss_mib: float
    fds: int


def usage(pid: int) -> Usage | None:
    """RSS (VmRSS) and open file descriptors of a process; None when it is gone."""
    try:
        rss_kib = next(
            int(line.split()[1])
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        )
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None
    return Usage(rss_kib / 1024, fds)


def processes(served: dict[str, Served]) -> dict[str, int]:
    """Every process of every serve: the supervisor, the router and each worker."""
    pids = {}
    for pipeline, s in served.items():
        kind = KIND[pipeline]
        pids[f"{kind}/serve"] = s.proc.pid
        for name, (_url, pid) in s.workers.items():
            pids[f"{kind}/{name}"] = pid
    return pids


def run(seconds: float, concurrency: int, quick: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        served: dict[str, Served] = {}
        clients: dict[str, openai.OpenAI] = {}
        try:
            if quick:
                served = Together(Path(tmp), MANIFESTS).take_all()
            else:
                for name, text in MANIFESTS.items():
                    path = Path(tmp) / f"{name}.yaml"
                    path.write_text(text)
                    t0 = time.monotonic()
                    served[name] = start_serve(path, timeout=300)
                    print(f"{name}: serve ready in {time.monotonic() - t0:.0f}s", flush=True)
            for kind in KINDS:
                s = served[IMAGE if kind == "image" else OMNI]
                clients[kind] = openai.OpenAI(
                    base_url=s.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
                )
            if not quick:  # --quick: the soak's own first requests pay the one-time costs
                for kind in KINDS:  # warm-up, not counted
                    CALLS[kind](clients[kind])
            pids = processes(served)
            start = {name: usage(pid) for name, pid in pids.items()}
            outcomes = Outcomes()
            print(f"soaking for {seconds:g}s at concurrency {concurrency} ...", flush=True)
            t0 = time.monotonic()
            soak(clients, concurrency, seconds, outcomes)
            wall = time.monotonic() - t0
            now = processes(served)
            end = {name: usage(pid) for name, pid in pids.items()}
            # Restarted: another pid now (what serve reports), or the process gone (all a
            # borrowed serve's borrower can see: its restarts are reported to the lender).
            restarted = sorted(
                name for name in pids if now.get(name) != pids[name] or end[name] is None
            )
        finally:
            for c in clients.values():
                c.close()
            for s in served.values():
                s.stop()
    kinds = {
        kind: {
            "ok": len(outcomes.latencies[kind]),
            "errors": dict(outcomes.errors[kind]),
            "p50_s": median(outcomes.latencies[kind]),
            "p99_s": percentile(outcomes.latencies[kind], 0.99),
        }
        for kind in KINDS
    }
    procs = {
        name: {
            "rss_mib_start": s.rss_mib if s else None,
            "rss_mib_end": e.rss_mib if e else None,
            "fds_start": s.fds if s else None,
            "fds_end": e.fds if e else None,
        }
        for name in pids
        for s, e in [(start[name], end[name])]
    }
    return {
        "seconds": seconds,
        "wall_s": wall,
        "concurrency": concurrency,
        "kinds": kinds,
        "processes": procs,
        "restarted": restarted,
        "error_examples": outcomes.examples,
    }


def fmt(value: object, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def report(results: dict[str, object], quick: bool, load: list[float]) -> None:
    kinds = results["kinds"]
    procs = results["processes"]
    assert isinstance(kinds, dict)
    assert isinstance(procs, dict)
    print()
    rows = []
    for kind, r in kinds.items():
        errors = ", ".join(f"{status}: {n}" for status, n in sorted(r["errors"].items()))
        rows.append(
            [
                kind,
                str(r["ok"] + sum(r["errors"].values())),
                str(r["ok"]),
                errors or "none",
                fmt(r["p50_s"] * 1e3, ".0f"),
                fmt(r["p99_s"] * 1e3, ".0f"),
            ]
        )
    print(table(["kind", "requests", "ok", "errors by status", "p50 ms", "p99 ms"], rows))
    print()
    rows = [
        [
            name,
            f"{fmt(p['rss_mib_start'], '.0f')} -> {fmt(p['rss_mib_end'], '.0f')}",
            f"{fmt(p['fds_start'], 'd')} -> {fmt(p['fds_end'], 'd')}",
        ]
        for name, p in procs.items()
    ]
    print(table(["process", "RSS MiB start -> end", "open fds start -> end"], rows))
    restarted = results["restarted"]
    assert isinstance(restarted, list)
    examples = results["error_examples"]
    assert isinstance(examples, dict)
    for what, message in examples.items():
        print(f"first {what}: {message}")
    print(
        f"({results['seconds']:g}s at concurrency {results['concurrency']}, the kinds in turn;"
        " images 64x64 x 4 steps, chats of 16 thinker tokens, audio of 50 talker codes;"
        f"\n restarted during the soak: {', '.join(restarted) or 'none'};"
        f" 1-minute load average {load[0]:.1f} before, {load[1]:.1f} after)"
    )
    record("soak", {**results, "load_average_1m": load}, quick)
    ok = sum(r["ok"] for r in kinds.values())
    errors = sum(sum(r["errors"].values()) for r in kinds.values())
    growth = [
        p["rss_mib_end"] - p["rss_mib_start"]
        for p in procs.values()
        if p["rss_mib_start"] is not None and p["rss_mib_end"] is not None
    ]
    fd_growth = [
        p["fds_end"] - p["fds_start"]
        for p in procs.values()
        if p["fds_start"] is not None and p["fds_end"] is not None
    ]
    wall = results["wall_s"]
    assert isinstance(wall, float)
    summary = {
        "requests": ok + errors,
        "errors": errors,
        "rps": (ok + errors) / wall,
        "max_rss_growth_mib": max(growth, default=float("nan")),
        "max_fd_growth": max(fd_growth, default=0),
        "restarted": len(restarted),
    }
    print(
        "soak: "
        + " ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to soak")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads")
    parser.add_argument("--quick", action="store_true", help="five seconds (the smoke test)")
    args = parser.parse_args()
    # A smoke run checks that every kind is answered and every figure read, not leaks:
    # each client's first request is of another kind, so a few seconds cover them all.
    minutes = 5 / 60 if args.quick else args.minutes
    if minutes <= 0 or args.concurrency < 1:
        parser.error("--minutes must be positive and --concurrency at least 1")
    load = [os.getloadavg()[0]]
    results = run(minutes * 60, args.concurrency, args.quick)
    load.append(os.getloadavg()[0])
    report(results, args.quick, load)


if __name__ == "__main__":
    main()
