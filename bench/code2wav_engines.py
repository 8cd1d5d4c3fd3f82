"""The Qwen Omni code2wav stages on vLLM against the same stages on transformers, in one
process, on the same tiny checkpoints (tiny://qwen2.5-omni, tiny://qwen3-omni) and the
same codes: seconds of audio made per second, and the wall time of a round of answers,
at 1, 4 and 16 answers at once.

Both stages are stepped as the worker steps them (every open session handed to
step_sessions at once), each answer given all its codes at the start, so every step
decodes a chunk of every answer: the transformers stage in one forward per group of
equal chunks, vLLM as one pooling request per chunk, scheduled together. Seeded, so both
make the same audio (test_vllm_code2wav.py holds them equal). One torch thread, as a
code2wav worker has on this 2-core machine.

    .venv/bin/python bench/code2wav_engines.py [--quick]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from _common import at_levels, record, table, without_exit_collection

from omnipipe.api.spec import Engine, Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.stagekit.code2wav import SAMPLE_RATE
from omnipipe.stagekit.stage import Chunk, StageJob, StreamingStage
from omnipipe.worker.stage_classes import stage_class
from tests.unit.test_omni_stages import spec

LEVELS = (1, 4, 16)
FAMILIES = ("qwen2.5-omni", "qwen3-omni")
# Codes per step of a chunk, and the codebook, of each tiny checkpoint.
SHAPES = {"qwen2.5-omni": (1, 128), "qwen3-omni": (4, 64)}


def load(model: str, path: str, engine: Engine) -> Any:
    stage_spec = spec("code2wav", Role.CODE2WAV, model)
    stage_spec = stage_spec.model_copy(update={"engine": engine})
    stage = stage_class(stage_spec, path)(stage_spec, path, "cpu")
    stage.load()
    return stage


def answers(family: str, count: int, codes: int) -> list[torch.Tensor]:
    groups, codebook = SHAPES[family]
    generator = torch.Generator().manual_seed(0)
    shape = (codes,) if groups == 1 else (codes, groups)
    return [torch.randint(0, codebook, shape, generator=generator) for _ in range(count)]


def round_of(stage: StreamingStage, codes: list[torch.Tensor]) -> tuple[float, float]:
    """Seconds for len(codes) answers decoded at once, and the audio seconds each made."""
    sessions = [stage.open(StageJob({"seed": i}, {})) for i in range(len(codes))]
    pending = {i: [Chunk("talker", {"codes": c}, True)] for i, c in enumerate(codes)}
    audio = [0.0] * len(sessions)
    open_ = list(range(len(sessions)))
    started = time.perf_counter()
    while open_:
        outcomes = stage.step_sessions([(sessions[i], pending.pop(i, [])) for i in open_])
        for i, outcome in zip(list(open_), outcomes, strict=True):
            if isinstance(outcome, Exception):
                raise outcome
            if outcome is None:
                continue
            audio[i] += outcome.audio_seconds
            if outcome.done:
                open_.remove(i)
    elapsed = time.perf_counter() - started
    for session in sessions:
        session.close()
    assert len(set(audio)) == 1, audio
    return elapsed, audio[0]


def measure(
    stage: StreamingStage, codes: list[torch.Tensor], levels: tuple[int, ...], repeats: int
) -> dict[str, dict[str, float]]:
    return at_levels(
        lambda n: round_of(stage, codes[:n]), levels, repeats, "audio_s_per_s", "s of audio/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="levels 1 and 4, one repeat")
    parser.add_argument("--codes", type=int, default=100, help="codes (frames) per answer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    levels = (1, 4) if args.quick else LEVELS
    repeats = 1 if args.quick else args.repeats
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    rows, summary = [], []
    engines: list[Any] = []
    for family in args.families.split(","):
        model = f"tiny://{family}"
        path = resolve_model_path(model)
        codes = answers(family, max(levels), args.codes)
        print(f"{family}, transformers:", flush=True)
        tf = measure(load(model, path, Engine.TRANSFORMERS), codes, levels, repeats)
        print(f"{family}, vllm:", flush=True)
        # Kept to the end: a vLLM engine that shuts down takes vLLM's process-wide
        # parallel state with it, which the next family's engine runs on.
        engines.append(load(model, path, Engine.VLLM))
        vllm = measure(engines[-1], codes, levels, repeats)
        results[family] = {"transformers": tf, "vllm": vllm}
        for level in levels:
            t, v = tf[str(level)], vllm[str(level)]
            ratio = v["audio_s_per_s"] / t["audio_s_per_s"]
            rows.append(
                [
                    family,
                    str(level),
                    f"{t['audio_s_per_s']:.1f}",
                    f"{v['audio_s_per_s']:.1f}",
                    f"{ratio:.2f}x",
                    f"{t['round_s'] * 1e3:.0f}",
                    f"{v['round_s'] * 1e3:.0f}",
                ]
            )
            summary.append(f"{family.replace('.', '')}_c{level}_vllm_over_transformers={ratio:.2f}")
    print(
        table(
            [
                "code2wav",
                "at once",
                "transformers audio s/s",
                "vLLM audio s/s",
                "vLLM/transformers",
                "tf round ms",
                "vLLM round ms",
            ],
            rows,
        )
    )
    print(f"torch threads: {torch.get_num_threads()}; sample rate {SAMPLE_RATE}")
    record(
        "code2wav_engines",
        {**results, "codes": args.codes, "repeats": repeats, "torch_threads": 1},
        args.quick,
    )
    print("code2wav_engines: " + " ".join(summary))


if __name__ == "__main__":
    main()
    without_exit_collection()
