"""Each image family's split graph beside diffusers' own pipeline, on the same tiny
checkpoint, seed, size and steps: a request's latency alone (concurrency 1), and the
split graph's throughput at concurrency 4 against its own at 1.

Targets (issue #43, CPU, tiny sizes): at concurrency 1 the split graph takes at most
1.05x diffusers' time; at concurrency 4 it gives at least 2x its concurrency-1
throughput (requests of one size share each DiT forward). The diffusers fallback
(`pipeline: diffusers`, sd3 and sana) runs the pipeline itself, whole: its row shows the
serving's own cost.

Each family's serve starts while the previous family is measured; diffusers' pipeline
runs in this process, on the same cores, before its family's serve is measured.

    .venv/bin/python bench/diffusion_families.py [--quick] [--families flux1-dev,sd3]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import median, record, table, without_exit_collection

if TYPE_CHECKING:
    from tests.e2e.conftest import Served

SIZE = 128
PROMPT = "a lighthouse at dusk"


@dataclass(frozen=True)
class Family:
    model: str
    pipeline: str
    steps: int
    # The call's guidance and negative prompt, as the family's pipeline takes them.
    call: dict[str, Any] = field(default_factory=dict)


CFG = {"guidance_scale": 4.0, "negative_prompt": "blurry"}
FAMILIES = {
    "qwen-image": Family("tiny://qwen-image", "qwen-image", 8, CFG),
    "flux1-dev": Family("tiny://flux1-dev", "flux", 8, {"guidance_scale": 3.5}),
    "flux1-schnell": Family("tiny://flux1-schnell", "flux", 4),
    "flux2-dev": Family("tiny://flux2-dev", "flux2", 8, {"guidance_scale": 4.0}),
    "flux2-klein": Family("tiny://flux2-klein", "flux2-klein", 4),
    "z-image-turbo": Family("tiny://z-image-turbo", "z-image", 8, {"guidance_scale": 0.0}),
    "sd3 (fallback)": Family("tiny://sd3", "diffusers", 8, CFG),
    "sana (fallback)": Family("tiny://sana", "diffusers", 8, CFG),
}
# The smoke run's: the pipeline the smoke test shares (tiny://qwen-image as it comes).
QUICK = ("qwen-image",)


def diffusers_call(family: Family, steps: int) -> Callable[[int], None]:
    """The checkpoint's own diffusers pipeline, one request at a time."""
    import torch
    from diffusers import DiffusionPipeline

    from omnipipe.checkpoints.tiny import resolve_model_path

    pipe: Any = DiffusionPipeline.from_pretrained(resolve_model_path(family.model))
    pipe.set_progress_bar_config(disable=True)
    arguments = {k: v for k, v in family.call.items() if k != "guidance_scale"}
    if "guidance_scale" in family.call:
        # Qwen-Image's true CFG scale is its pipeline's true_cfg_scale.
        key = "true_cfg_scale" if family.model == "tiny://qwen-image" else "guidance_scale"
        arguments[key] = family.call["guidance_scale"]

    def call(i: int) -> None:
        with torch.inference_mode():
            pipe(
                prompt=PROMPT,
                height=SIZE,
                width=SIZE,
                num_inference_steps=steps,
                generator=torch.Generator().manual_seed(i),
                **arguments,
            )

    return call


def manifest(family: Family) -> str:
    """The family's pipeline as it comes (qwen-image's is the one the smoke run shares)."""
    import yaml

    name = "tiny-image" if family.pipeline == "qwen-image" else family.pipeline
    spec = {"model": family.model, "pipeline": family.pipeline}
    return yaml.safe_dump(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


def served_call(base_url: str, family: Family, steps: int) -> Callable[[int], None]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="any", max_retries=0, timeout=600)
    [model] = client.models.list().data

    def call(i: int) -> None:
        client.images.generate(
            model=model.id,
            prompt=PROMPT,
            size=f"{SIZE}x{SIZE}",
            extra_body={"num_inference_steps": steps, "seed": i, **family.call},
        )

    return call


def level(call: Callable[[int], None], concurrency: int, requests: int) -> tuple[float, float]:
    """(median seconds a request, requests a second) of `requests` at `concurrency`."""
    from throughput import drive

    done = drive(call, concurrency, requests, cap_s=600)
    if done.errors:
        raise RuntimeError(f"{done.errors} requests failed")
    return median(done.latencies), done.throughput


def started(family: Family, work: Path) -> Served:
    """The family's serve: the smoke run's shared one where it is that, else its own."""
    from _serves import borrow

    from tests.e2e.conftest import start_serve

    text = manifest(family)
    if (shared := borrow(text)) is not None:
        return shared
    path = work / f"{family.pipeline}-{family.model.removeprefix('tiny://')}.yaml"
    path.write_text(text)
    return start_serve(path, timeout=300)


def main() -> None:
    from _serves import release

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="qwen-image alone, few requests")
    parser.add_argument("--families", help=f"comma-separated, of: {', '.join(FAMILIES)}")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    names = args.families.split(",") if args.families else list(QUICK if args.quick else FAMILIES)
    if unknown := [n for n in names if n not in FAMILIES]:
        parser.error(f"unknown families: {', '.join(unknown)}")
    repeats = 1 if args.quick else args.repeats
    requests = 1 if args.quick else 4
    steps_of = {n: min(FAMILIES[n].steps, 4) if args.quick else FAMILIES[n].steps for n in names}
    rows, results = [], {}
    with (
        tempfile.TemporaryDirectory(prefix="omnipipe-bench-") as work,
        ThreadPoolExecutor(1) as pool,
    ):

        def start(name: str) -> Future[Served]:
            return pool.submit(started, FAMILIES[name], Path(work))

        starting = start(names[0])
        for k, name in enumerate(names):
            family, steps = FAMILIES[name], steps_of[name]
            print(f"{name} ({family.model}, {SIZE}x{SIZE}, {steps} steps)", flush=True)
            served = starting.result()
            reference = diffusers_call(family, steps)
            reference(0)  # first-call allocations stay out of the figures
            ref_s = median([level(reference, 1, requests)[0] for _ in range(repeats)])
            try:
                call = served_call(served.base_url, family, steps)
                call(0)
                c1 = [level(call, 1, requests) for _ in range(repeats)]
                c4 = [level(call, 4, 4 * requests) for _ in range(repeats)]
            finally:
                if k + 1 < len(names):
                    starting = start(names[k + 1])
                release(served)
            ours_s = median([s for s, _ in c1])
            c1_rps, c4_rps = median([r for _, r in c1]), median([r for _, r in c4])
            results[name] = {
                "diffusers_s": ref_s,
                "split_c1_s": ours_s,
                "c1_vs_diffusers": ours_s / ref_s,
                "split_c1_img_per_s": c1_rps,
                "split_c4_img_per_s": c4_rps,
                "c4_over_c1": c4_rps / c1_rps,
                "steps": steps,
            }
            r = results[name]
            rows.append(
                [
                    name,
                    f"{ref_s * 1e3:.0f}",
                    f"{ours_s * 1e3:.0f}",
                    f"{r['c1_vs_diffusers']:.2f}x",
                    "met" if r["c1_vs_diffusers"] <= 1.05 else "missed",
                    f"{c1_rps:.2f}",
                    f"{c4_rps:.2f}",
                    f"{r['c4_over_c1']:.2f}x",
                    "met" if r["c4_over_c1"] >= 2 else "missed",
                ]
            )
    headers = [
        "family",
        "diffusers ms",
        "split c1 ms",
        "c1 / diffusers",
        "<=1.05x",
        "c1 img/s",
        "c4 img/s",
        "c4 / c1",
        ">=2x",
    ]
    print(table(headers, rows))
    print(f"{SIZE}x{SIZE}, medians of {repeats} repeats of {requests} requests a level")
    record("diffusion_families", {**results, "size": SIZE, "repeats": repeats}, args.quick)
    print(
        "diffusion_families: "
        + " ".join(
            f"{n.split(' ')[0]}_c1_vs_diffusers={r['c1_vs_diffusers']:.2f} "
            f"{n.split(' ')[0]}_c4_over_c1={r['c4_over_c1']:.2f}"
            for n, r in results.items()
        )
    )


if __name__ == "__main__":
    main()
    without_exit_collection()
