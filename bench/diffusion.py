"""Diffusion on the CPU: diffusers' monolithic QwenImagePipeline (one process, the anchor)
beside this checkout's `omnipipe serve` split graph, plain and with each of the denoiser's
accelerations (the step cache: cache-dit's DBCache; CFG-parallel over two DiT copies;
int8 weights through torchao), in the same run on tiny://qwen-image.

The workload: 128x128, 20 steps, true CFG (a negative prompt, guidance 4). The monolith
runs CFG as two transformer forwards a step, one request at a time (a single-server
deployment's engine); the split graph runs both branches as one forward and requests
side by side; CFG-parallel runs the negative branch on a second copy beside the
positive one (on the CPU both copies share the same cores, so it shows the cost of the
split, not a second device's gain). Closed-loop clients at concurrency 1 and 4; medians
of --repeats runs; each row's ratio is to the monolith at the same concurrency.
Step-cache rows also report the steps reused, from the worker's omnipipe_stage_denoise_steps_total.

The GPU side, --device cuda, is bench/diffusion_real_size.py (Qwen-Image at its released
size with random weights, the monolith beside the stages in one process); the arguments
after --device cuda go to it.

    .venv/bin/python bench/diffusion.py [--quick] [--repeats N]
    python bench/diffusion.py --device cuda [diffusion_real_size.py's arguments]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import percentile, record, table, without_exit_collection
from _serves import Releasing, serving

if TYPE_CHECKING:
    from throughput import Level

    from tests.e2e.conftest import Served

SIZE, STEPS, GUIDANCE = 128, 20, 4.0
# --quick (the smoke run) proves each server runs end to end: fewer steps, still past the
# step cache's warm-up so that it reuses some.
QUICK_STEPS = 8
# The tiny model's random weights move its residuals far more per step than a trained
# model's: 0.4 reuses about 9 of its 20 steps here (0.2 reuses none); a real model's
# threshold is cache-dit's usual 0.05-0.2.
CACHE = {"threshold": 0.4, "warmupSteps": 4, "firstBlocks": 1}
VARIANTS: dict[str, dict[str, Any] | None] = {
    "split graph": None,
    "split graph + step cache": {"cache": CACHE},
    "split graph + CFG-parallel": {"cfgParallelSize": 2},
    "split graph + int8 weights": {"quantization": {"method": "int8-weight-only"}},
}


def manifest(acceleration: dict[str, Any] | None) -> str:
    import yaml

    spec: dict[str, Any] = {"model": "tiny://qwen-image", "pipeline": "qwen-image"}
    if acceleration:
        spec["stages"] = [{"name": "denoise", "acceleration": acceleration}]
    return yaml.safe_dump(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": "tiny-image"},
            "spec": spec,
        }
    )


def monolith_call(steps: int) -> Callable[[int], None]:
    """diffusers' whole pipeline behind one lock: requests run one at a time."""
    import torch
    from diffusers import QwenImagePipeline

    from omnipipe.checkpoints.tiny import resolve_model_path

    pipe: Any = QwenImagePipeline.from_pretrained(resolve_model_path("tiny://qwen-image"))
    pipe.set_progress_bar_config(disable=True)
    engine = threading.Lock()

    def call(i: int) -> None:
        with engine, torch.inference_mode():
            pipe(
                prompt="a lighthouse at dusk",
                negative_prompt="blurry",
                true_cfg_scale=GUIDANCE,
                height=SIZE,
                width=SIZE,
                num_inference_steps=steps,
                generator=torch.Generator().manual_seed(i),
            )

    return call


def served_call(served: Served, steps: int) -> Callable[[int], None]:
    import openai

    client = openai.OpenAI(base_url=served.base_url, api_key="any", max_retries=0)

    def call(i: int) -> None:
        client.images.generate(
            model="tiny-image",
            prompt="a lighthouse at dusk",
            size=f"{SIZE}x{SIZE}",
            extra_body={
                "negative_prompt": "blurry",
                "guidance_scale": GUIDANCE,
                "num_inference_steps": steps,
                "seed": i,
            },
        )

    return call


def reused_share(served: Served) -> float:
    counts = {"computed": 0.0, "reused": 0.0}
    for line in served.metrics("denoise-0").splitlines():
        if line.startswith("omnipipe_stage_denoise_steps_total{"):
            for kind in counts:
                if f'kind="{kind}"' in line:
                    counts[kind] += float(line.rsplit(" ", 1)[1])
    total = counts["computed"] + counts["reused"]
    return counts["reused"] / total if total else 0.0


def measure(
    call: Callable[[int], None], levels: list[int], requests: int, repeats: int, warm: bool
) -> dict[int, Level]:
    from throughput import drive

    if warm:  # first-call allocations and lazy imports stay out of the figures
        call(0)
    runs: dict[int, list[Level]] = {c: [] for c in levels}
    for _ in range(repeats):
        for c in levels:
            runs[c].append(drive(call, c, requests * c, cap_s=120))
    # The repeat with the median throughput stands for the level.
    return {c: sorted(r, key=lambda lv: lv.throughput)[len(r) // 2] for c, r in runs.items()}


def main() -> None:
    device = argparse.ArgumentParser(add_help=False)
    device.add_argument("--device", default="cpu")
    chosen, rest = device.parse_known_args()
    if chosen.device == "cuda":
        import diffusion_real_size

        sys.argv[1:] = ["--device", "cuda", *rest]
        diffusion_real_size.main()
        return
    from tests.e2e.conftest import start_serve

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: the GPU side, bench/diffusion_real_size.py (its arguments follow)",
    )
    parser.add_argument("--quick", action="store_true", help="one repeat, few requests, no warm-up")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    requests = 1 if args.quick else 6
    warm = not args.quick
    steps = QUICK_STEPS if args.quick else STEPS
    levels = [1, 4]
    results: dict[str, dict[int, Level]] = {}
    reused: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="omnipipe-bench-") as directory:
        # --quick: the variants' serves start together while the monolith loads, and each
        # is stopped in the background once measured. The monolith is measured once they
        # are ready: its two torch threads beside their start wait on cores that the
        # start holds (a 0.2 s image took 13 s), and spin on them.
        texts = {name: manifest(acceleration) for name, acceleration in VARIANTS.items()}
        with (
            serving(Path(directory), texts if args.quick else {}) as servers,
            Releasing(background=args.quick) as release,
        ):
            print(
                f"monolith (diffusers QwenImagePipeline, {SIZE}x{SIZE}, {steps} steps, CFG)",
                flush=True,
            )
            monolith = monolith_call(steps)
            servers.wait()
            results["monolith"] = measure(monolith, levels, requests, repeats, warm)
            for name, acceleration in VARIANTS.items():
                print(name, flush=True)
                served = servers.take(name)
                if served is None:
                    path = Path(directory) / f"{len(results)}.yaml"
                    path.write_text(manifest(acceleration))
                    served = start_serve(path, timeout=300)
                try:
                    results[name] = measure(
                        served_call(served, steps), levels, requests, repeats, warm
                    )
                    reused[name] = reused_share(served)
                finally:
                    release(served)
    rows, recorded = [], {}
    for name, by_level in results.items():
        for c, level in by_level.items():
            anchor = results["monolith"][c].throughput
            ratio = level.throughput / anchor if anchor else float("nan")
            p50 = percentile(level.latencies, 0.5) * 1000
            rows.append(
                [
                    name,
                    str(c),
                    f"{p50:.0f}",
                    f"{level.throughput:.2f}",
                    f"{ratio:.2f}x",
                    f"{reused[name]:.0%}" if name in reused else "-",
                    str(level.errors),
                ]
            )
            key = name.replace(" + ", "_").replace(" ", "_").replace("-", "_").lower()
            recorded[f"{key}_c{c}"] = {
                "p50_ms": p50,
                "img_per_s": level.throughput,
                "vs_monolith": ratio,
                "errors": level.errors,
            }
    headers = ["server", "c", "p50 ms", "img/s", "vs monolith", "steps reused", "errors"]
    print(table(headers, rows))
    record("diffusion", {**recorded, "steps_reused_share": reused}, args.quick)
    split, cached = results["split graph"], results["split graph + step cache"]
    parallel, int8 = results["split graph + CFG-parallel"], results["split graph + int8 weights"]
    print(
        "diffusion: "
        f"split_c4_vs_monolith={split[4].throughput / results['monolith'][4].throughput:.2f} "
        f"cache_c1_vs_split={cached[1].throughput / split[1].throughput:.2f} "
        f"cfg_parallel_c1_vs_split={parallel[1].throughput / split[1].throughput:.2f} "
        f"int8_c1_vs_split={int8[1].throughput / split[1].throughput:.2f} "
        f"steps_reused={reused['split graph + step cache']:.2f} "
        f"errors={sum(lv.errors for r in results.values() for lv in r.values())}"
    )


if __name__ == "__main__":
    main()
    without_exit_collection()
