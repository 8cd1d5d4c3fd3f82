"""The Qwen Omni talkers on vLLM against the same talkers on transformers, in one process,
on the same tiny checkpoints (tiny://qwen2.5-omni, tiny://qwen3-omni) and the same
thinker output: talker steps (codes, or Qwen3 frames) per second and the wall time of a
round of answers, at 1, 4 and 16 answers at once.

Both stages are stepped as the worker steps them (every open session handed to
step_sessions at once): the transformers talker runs one forward per answer per step,
vLLM one batched step for all of them. The thinker's chunks (transformers, greedy) are
made once and given to every answer whole, so only the talker is timed. Greedy, with
min_tokens = max_tokens, so both engines make the same codes (test_vllm_talker.py holds
them equal). Both run on one torch thread, as a talker worker does on this 2-core machine.

    .venv/bin/python bench/talker_engines.py [--quick]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from _common import at_levels, record, table, without_exit_collection

from omnipipe.api.spec import Engine, Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.stagekit.stage import Chunk, StageJob, StreamingStage
from omnipipe.worker.stage_classes import stage_class
from tests.unit.test_omni_stages import spec, thinker_chunks

LEVELS = (1, 4, 16)
THINKER_TOKENS = 16
FAMILIES = ("qwen2.5-omni", "qwen3-omni")


def load(model: str, path: str, role: Role, engine: Engine = Engine.TRANSFORMERS) -> Any:
    args = {"max_model_len": 2048} if engine is Engine.VLLM else {}
    stage_spec = spec(role.value, role, model, engine_args=args)
    stage_spec = stage_spec.model_copy(update={"engine": engine})
    stage = stage_class(stage_spec, path)(stage_spec, path, "cpu")
    stage.load()
    return stage


def replies_of(model: str, path: str, count: int) -> list[list[Chunk]]:
    """The thinker's chunks for `count` different chats."""
    thinker = load(model, path, Role.THINKER)
    sampling = {"temperature": 0, "max_tokens": THINKER_TOKENS, "min_tokens": THINKER_TOKENS}
    return [
        thinker_chunks(
            thinker,
            sampling,
            [{"role": "user", "content": f"Tell me about the weather in Paris, day {i}."}],
            voice="chelsie",
        )
        for i in range(count)
    ]


def round_of(stage: StreamingStage, replies: list[list[Chunk]], codes: int) -> tuple[float, int]:
    """Seconds for len(replies) answers of `codes` codes each, all open at once, and the
    steps each made (Qwen3's last code ends the answer and makes no frame)."""
    sampling = {"temperature": 0, "max_tokens": codes, "min_tokens": codes}
    sessions = [stage.open(StageJob({"sampling": sampling}, {})) for _ in replies]
    pending = {i: list(chunks) for i, chunks in enumerate(replies)}
    made = [0] * len(sessions)
    open_ = list(range(len(sessions)))
    started = time.perf_counter()
    try:
        while open_:
            work = [(sessions[i], pending.pop(i, [])) for i in open_]
            outcomes = stage.step_sessions(work)
            for i, outcome in zip(list(open_), outcomes, strict=True):
                if isinstance(outcome, Exception):
                    raise outcome
                if outcome is None:
                    continue
                if "codes" in outcome.tensors:
                    made[i] += len(outcome.tensors["codes"])
                if outcome.done:
                    open_.remove(i)
    finally:
        for session in sessions:
            session.close()
    elapsed = time.perf_counter() - started
    assert len(set(made)) == 1, made
    assert made[0] in (codes, codes - 1), made
    return elapsed, made[0]


def measure(
    stage: StreamingStage,
    replies: list[list[Chunk]],
    levels: tuple[int, ...],
    codes: int,
    repeats: int,
) -> dict[str, dict[str, float]]:
    return at_levels(
        lambda n: round_of(stage, replies[:n], codes), levels, repeats, "codes_per_s", "steps/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="levels 1 and 4, one repeat")
    parser.add_argument("--codes", type=int, help="talker codes per answer (64; --quick 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    levels = (1, 4) if args.quick else LEVELS
    repeats = 1 if args.quick else args.repeats
    # --quick: still more than one 25-code chunk per answer, at half the steps.
    codes = args.codes if args.codes is not None else (32 if args.quick else 64)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    rows = []
    summary = []
    engines: list[Any] = []
    for family in args.families.split(","):
        model = f"tiny://{family}"
        path = resolve_model_path(model)
        replies = replies_of(model, path, max(levels))
        print(f"{family}, transformers:", flush=True)
        tf = measure(load(model, path, Role.TALKER), replies, levels, codes, repeats)
        print(f"{family}, vllm:", flush=True)
        # Kept to the end: a vLLM engine that shuts down takes vLLM's process-wide
        # parallel state with it, which the next family's engine runs on.
        engines.append(load(model, path, Role.TALKER, Engine.VLLM))
        vllm = measure(engines[-1], replies, levels, codes, repeats)
        results[family] = {"transformers": tf, "vllm": vllm}
        for level in levels:
            t, v = tf[str(level)], vllm[str(level)]
            ratio = v["codes_per_s"] / t["codes_per_s"]
            rows.append(
                [
                    family,
                    str(level),
                    f"{t['codes_per_s']:.0f}",
                    f"{v['codes_per_s']:.0f}",
                    f"{ratio:.2f}x",
                    f"{t['round_s'] * 1e3:.0f}",
                    f"{v['round_s'] * 1e3:.0f}",
                ]
            )
            tag = family.replace(".", "")
            summary.append(f"{tag}_c{level}_vllm_over_transformers={ratio:.2f}")
    results["torch_threads"] = torch.get_num_threads()
    print(
        table(
            [
                "talker",
                "at once",
                "transformers steps/s",
                "vLLM steps/s",
                "vLLM/transformers",
                "tf round ms",
                "vLLM round ms",
            ],
            rows,
        )
    )
    print(f"torch threads: {results['torch_threads']}")
    record("talker_engines", {**results, "codes": codes, "repeats": repeats}, args.quick)
    print("talker_engines: " + " ".join(summary))


if __name__ == "__main__":
    main()
    without_exit_collection()
