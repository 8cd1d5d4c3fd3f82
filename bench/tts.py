"""Qwen3-TTS under load: closed-loop streaming clients of `omnipipe serve
tiny://qwen3-tts-custom-voice` at rising concurrency, beside the model authors' qwen-tts
(generate_custom_voice, one request at a time, in its side environment) in the same run.

Each client asks for raw PCM streamed as it is made (`stream_format: audio`), the same
text, voice and length, a seed per request, and sends its next request when the last
ends. Per level: time to first audio (p50, p99; the first non-empty body chunk), audio
seconds made per wall second, and the real-time factor (a request's wall time over the
audio it made; under 1 is faster than real time). qwen-tts answers a request whole, so its
first audio is its whole request.

Targets (#42): first audio p50 at 16 clients at most 2x that at 1; audio per second at 16
at least 4x that at 1.

The anchor runs on one torch thread; omnipipe's talker and code2wav workers split the
machine's cores between them (worker/threads.py). On the CPU the c1 ratios to qwen-tts
compare a process against a pipeline of two, each with its own share.

    .venv/bin/python bench/tts.py [--quick] [--levels 1,4,16,32] [--requests 4]
        [--engines vllm,transformers]

With both engines, each talker's serve runs the same levels, one after the other, and the
table gives each beside the other and the anchor.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from _common import median, percentile, record, table
from _serves import release, serving

from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.qwen3_tts.reference_env import reference_python
from tests.e2e.conftest import Served

MODEL = "tiny://qwen3-tts-custom-voice"
ENGINES = ("vllm", "transformers")  # the default first


def manifest(engine: str) -> str:
    """The pipeline with its talker on `engine` (code2wav on transformers either way)."""
    return f"""apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {{name: tts}}
spec:
  model: {MODEL}
  pipeline: qwen3-tts
  stages:
  - name: talker
    engine: {engine}
"""


TEXT = "The train to the airport leaves from platform four at a quarter past noon."
VOICE = "vivian"
RATE = 24000  # 16-bit mono PCM


def one_request(url: str, seed: int, max_new_tokens: int) -> tuple[float, float, float]:
    """(seconds to the first audio, seconds to the end, audio seconds) of one request."""
    body = {
        "model": "tts",
        "input": TEXT,
        "voice": VOICE,
        "response_format": "pcm",
        "stream_format": "audio",
        "language": "english",
        "seed": seed,
        "max_new_tokens": max_new_tokens,
    }
    started = time.perf_counter()
    first, size = 0.0, 0
    with httpx.stream("POST", f"{url}/audio/speech", json=body, timeout=600) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            if chunk and not first:
                first = time.perf_counter() - started
            size += len(chunk)
    return first, time.perf_counter() - started, size / 2 / RATE


# Where first audio goes (#42's profile of its TTFA target): the workers' own histograms,
# their mean over a level (the difference of their sums over that of their counts).
BREAKDOWN = {
    "talker_queue": ("talker", "omnipipe_stage_queue_wait_seconds"),
    "talker_first_codes": ("talker", "omnipipe_stage_time_to_first_audio_seconds"),
    "code2wav_queue": ("code2wav", "omnipipe_stage_queue_wait_seconds"),
    "code2wav_first_audio": ("code2wav", "omnipipe_stage_time_to_first_audio_seconds"),
}


def histogram_totals(served: Served) -> dict[str, tuple[float, float]]:
    """BREAKDOWN's histograms' (sum, count), over each stage's workers."""
    totals: dict[str, tuple[float, float]] = {}
    for key, (stage, name) in BREAKDOWN.items():
        workers = [w for w in served.workers if w.rsplit("-", 1)[0] == stage]
        totals[key] = (
            sum(served.metric(w, f"{name}_sum") for w in workers),
            sum(served.metric(w, f"{name}_count") for w in workers),
        )
    return totals


def breakdown_of(
    served: Served, run: Callable[[], dict[str, float]]
) -> tuple[dict[str, float], dict[str, float | None]]:
    """run()'s row, and BREAKDOWN's means over it in ms (None: no such event)."""
    before = histogram_totals(served)
    row = run()
    after = histogram_totals(served)
    means: dict[str, float | None] = {}
    for key, (total, count) in after.items():
        n = count - before[key][1]
        means[key] = (total - before[key][0]) / n * 1e3 if n else None
    return row, means


def shown_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def level_of(url: str, clients: int, requests: int, max_new_tokens: int) -> dict[str, float]:
    """`clients` closed-loop clients, `requests` each."""
    results: list[tuple[float, float, float]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for n in range(requests):
            try:
                got = one_request(url, index * 1000 + n, max_new_tokens)
            except Exception as exc:
                errors.append(exc)
                return
            with lock:
                results.append(got)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed at {clients} clients: {errors[0]!r}")
    if any(not r[2] for r in results):
        raise RuntimeError(f"a request at {clients} clients got no audio")
    first = [r[0] for r in results]
    audio = sum(r[2] for r in results)
    return {
        "ttfa_p50_s": median(first),
        "ttfa_p99_s": percentile(first, 0.99),
        "audio_s_per_s": audio / wall,
        "rtf_p50": median([r[1] / r[2] for r in results if r[2]]),
        "requests": len(results),
    }


def anchor(requests: int, max_new_tokens: int) -> dict[str, float]:
    """qwen-tts's generate_custom_voice, one request at a time."""
    script = Path(__file__).with_name("_qwen_tts_anchor.py")
    checkpoint = resolve_model_path(MODEL)
    ran = subprocess.run(
        [
            *(str(reference_python()), "-P", str(script), checkpoint, TEXT, VOICE),
            *(str(max_new_tokens), str(requests)),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if ran.returncode != 0:
        raise RuntimeError(f"qwen-tts's run failed:\n{ran.stderr[-3000:]}")
    said = json.loads(ran.stdout.strip().splitlines()[-1])
    seconds, audio = said["seconds"], said["audio_seconds"]
    return {
        "ttfa_p50_s": median(seconds),
        "ttfa_p99_s": percentile(seconds, 0.99),
        "audio_s_per_s": sum(audio) / sum(seconds),
        "rtf_p50": median([s / a for s, a in zip(seconds, audio, strict=True) if a]),
        "requests": len(seconds),
    }


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="levels 1 and 4, short speech")
    parser.add_argument("--levels", default=None, help="comma-separated (default 1,4,16,32)")
    parser.add_argument("--requests", type=int, default=None, help="per client, per level")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument(
        "--engines",
        default=None,
        help="the talker's engines, comma-separated (default vllm,transformers; --quick "
        "transformers, the one that starts in seconds)",
    )
    args = parser.parse_args()
    engines = (args.engines or ("transformers" if args.quick else ",".join(ENGINES))).split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: {', '.join(unknown)} is not one of {', '.join(ENGINES)}")
    levels = [int(x) for x in (args.levels or ("1,4" if args.quick else "1,4,16,32")).split(",")]
    requests = args.requests or (2 if args.quick else 4)
    max_new_tokens = args.max_new_tokens or (16 if args.quick else 60)
    with (
        tempfile.TemporaryDirectory(prefix="omnipipe-bench-tts-") as work,
        contextlib.ExitStack() as stack,
    ):
        texts = {engine: manifest(engine) for engine in engines}
        # --quick: the serves start while the anchor runs (on one torch thread), not after.
        serves = stack.enter_context(serving(Path(work), texts)) if args.quick else None
        print(f"qwen-tts (anchor): {requests * 2} requests, one at a time", flush=True)
        rows: dict[str, Any] = {"qwen-tts": anchor(requests * 2, max_new_tokens)}
        serves = serves or stack.enter_context(serving(Path(work), texts))
        by_engine: dict[str, dict[str, dict[str, float]]] = {}
        profiles: dict[str, dict[str, dict[str, float | None]]] = {}
        for engine in engines:
            served = serves.take(engine)
            assert served is not None
            try:
                one_request(served.base_url, 0, max_new_tokens)  # one-time costs
                by_engine[engine], profiles[engine] = {}, {}
                for clients in levels:
                    print(f"omnipipe, talker on {engine}: {clients} clients", flush=True)
                    run = functools.partial(
                        level_of, served.base_url, clients, requests, max_new_tokens
                    )
                    row, means = breakdown_of(served, run)
                    by_engine[engine][str(clients)], profiles[engine][str(clients)] = row, means
            finally:
                # Taken, it is ours to stop (close() stops only those not taken): left
                # running, it outlived the run, a whole TTS pipeline's memory each time.
                release(served)
        serves.close()
    # The first engine's rows are "omnipipe" (the vLLM talker's, the default, by default).
    ours = by_engine[engines[0]]
    rows["omnipipe"] = ours
    for engine in engines[1:]:
        rows[f"omnipipe-{engine}"] = by_engine[engine]
    named = [
        ("qwen-tts c1", rows["qwen-tts"]),
        *((f"{engine} c{c}", r) for engine in engines for c, r in by_engine[engine].items()),
    ]
    lines = [
        [
            *(name, f"{r['ttfa_p50_s'] * 1e3:.0f}", f"{r['ttfa_p99_s'] * 1e3:.0f}"),
            *(f"{r['audio_s_per_s']:.2f}", f"{r['rtf_p50']:.2f}"),
        ]
        for name, r in named
    ]
    print(table(["server", "TTFA p50 ms", "TTFA p99 ms", "audio s/s", "RTF p50"], lines))
    print("where first audio goes (the workers' means, ms):")
    print(
        table(
            ["server", *BREAKDOWN],
            [
                [f"{engine} c{c}", *(shown_ms(r[key]) for key in BREAKDOWN)]
                for engine in engines
                for c, r in profiles[engine].items()
            ],
        )
    )
    low, high = ours[str(levels[0])], ours[str(levels[-1])]
    summary = {
        f"ttfa_c{levels[-1]}_over_c{levels[0]}": ratio(high["ttfa_p50_s"], low["ttfa_p50_s"]),
        f"audio_c{levels[-1]}_over_c{levels[0]}": ratio(
            high["audio_s_per_s"], low["audio_s_per_s"]
        ),
        "ttfa_c1_vs_qwen_tts": ratio(low["ttfa_p50_s"], rows["qwen-tts"]["ttfa_p50_s"]),
        "rtf_c1_vs_qwen_tts": ratio(low["rtf_p50"], rows["qwen-tts"]["rtf_p50"]),
    }
    for engine in engines[1:]:
        theirs = by_engine[engine]
        for c in (str(levels[0]), str(levels[-1])):
            summary[f"{engine}_audio_c{c}_over_{engines[0]}"] = ratio(
                theirs[c]["audio_s_per_s"], ours[c]["audio_s_per_s"]
            )
    for engine, levels_of in by_engine.items():
        if "16" in levels_of and "1" in levels_of:
            ttfa = ratio(levels_of["16"]["ttfa_p50_s"], levels_of["1"]["ttfa_p50_s"])
            audio = ratio(levels_of["16"]["audio_s_per_s"], levels_of["1"]["audio_s_per_s"])
            print(
                f"targets (#42), talker on {engine}: TTFA p50 c16/c1 <= 2: {ttfa:.2f}; "
                f"audio/s c16/c1 >= 4: {audio:.2f}"
            )
    rows["summary"] = summary
    rows["first_audio_breakdown_ms"] = profiles
    record("tts", rows, args.quick)
    print("tts: " + " ".join(f"{k}={v:.2f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
