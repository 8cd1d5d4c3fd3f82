"""Qwen-Image at its released size on one GPU: diffusers' monolithic QwenImagePipeline
beside omnipipe's three stages (TextEncodeStage -> SteppedDenoiseStage -> DecodeStage),
with and without cache-dit's step cache, on the same random-weight model in one process.

No checkpoint is downloaded: the DiT (20B, diffusers' default config is the released
one), the Qwen2.5-VL-7B text encoder (its vision tower too) and the VAE are built with
random weights straight onto the device in bfloat16. The per-step cost is the real one;
the images are noise. The tokenizer is tiny://'s byte tokenizer, so a prompt is longer in
tokens than under Qwen's BPE (both sides see the same text; the DiT's 4096 image tokens
at 1024x1024 dominate either way).

The stages run in this one process, driven as a worker drives them: each request's
encode, then the requests' denoising together (their rows share each step: one forward
per text length on a GPU), then each decode. What `omnipipe serve`
adds on top (the router, the hand-offs of ~1 MB of embeddings and latents) is not timed
here. The monolith runs at concurrency 4 as one call with four prompts (diffusers' own
batching, the fastest it goes); one-at-a-time is four times its concurrency-1 figure.
The stages share the monolith's modules, so the GPU holds one copy of the weights.

    python bench/diffusion_real_size.py --device cuda            # on the GPU machine
    python bench/diffusion_real_size.py --device cpu --size tiny --quick   # smoke run
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
for folder in (REPO, REPO / "bench"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

PROMPT = "a lighthouse on a cliff at dusk, waves breaking below, warm light in the windows"
NEGATIVE = "blurry, low quality"
GUIDANCE = 4.0

# Qwen2.5-VL-7B-Instruct's text model and vision tower (Qwen-Image's text encoder).
TEXT_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default"},
}
VISION_7B = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "window_size": 112,
}
# The same shapes' structure, small enough for a CPU smoke run.
TINY = {
    "transformer": {
        "num_layers": 4,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "axes_dims_rope": (4, 6, 6),
    },
    "vae": {"base_dim": 8, "num_res_blocks": 1},
    "text": {
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default"},
    },
    "vision": {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_heads": 2,
        "out_hidden_size": 32,
    },
}
# Qwen-Image's released scheduler: dynamic (resolution-dependent) shifting.
SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}


@contextmanager
def building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """New tensors are made on `device` in `dtype`: a 20B model's random init then runs
    on the GPU, in its final dtype, with no float32 copy on the host."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)


def build_pipeline(size: str, device: torch.device, dtype: torch.dtype, scratch: Path) -> Any:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from omnipipe.stagekit.tokenizer import save_byte_tokenizer

    tiny = size == "tiny"
    torch.manual_seed(0)
    with building_on(device, dtype):
        transformer = QwenImageTransformer2DModel(**(TINY["transformer"] if tiny else {}))
        vae = AutoencoderKLQwenImage(**(TINY["vae"] if tiny else {}))
        text_encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config=TINY["text"] if tiny else TEXT_7B,
                vision_config=TINY["vision"] if tiny else VISION_7B,
            )
        )
    pipe = QwenImagePipeline(
        transformer=transformer.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        text_encoder=text_encoder.eval(),
        tokenizer=save_byte_tokenizer(scratch / "tokenizer"),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def weights_gib(module: torch.nn.Module) -> float:
    return gib(sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]))


class Clock:
    """Wall time of GPU work: synchronizes at each reading."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def reset_peak(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_above(self, base: int) -> float:
        if self.device.type != "cuda":
            return 0.0
        return gib(torch.cuda.max_memory_allocated(self.device) - base)


def png_b64(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def run_monolith(pipe: Any, n: int, side: int, steps: int) -> list[str]:
    """One call of the whole pipeline for n prompts; the images as a server sends them."""
    with torch.inference_mode():
        images = pipe(
            prompt=[PROMPT] * n,
            negative_prompt=[NEGATIVE] * n,
            true_cfg_scale=GUIDANCE,
            height=side,
            width=side,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(0),
        ).images
    return [png_b64(image) for image in images]


@dataclass
class Stages:
    encode: Any
    denoise: Any
    decode: Any
    steps: dict[str, int] = field(default_factory=lambda: {"computed": 0, "reused": 0})


def make_stages(pipe: Any, device: torch.device, cache: dict[str, Any] | None) -> Stages:
    """omnipipe's three Qwen-Image stages, loading `pipe`'s modules instead of a checkpoint."""
    from omnipipe.api.acceleration import Acceleration
    from omnipipe.api.resolve import ResolvedStage
    from omnipipe.api.roles import Engine, Role
    from omnipipe.families.qwen_image import denoise, stages

    def spec(name: str, role: Role, acceleration: Acceleration | None = None) -> ResolvedStage:
        return ResolvedStage(
            name=name, role=role, engine=Engine.DIFFUSERS, model="random-weights",
            inputs=(), replicas=1, cpu=None, memory=None, gpus=1 if device.type == "cuda" else 0,
            engine_args={}, sampling={}, env=(), node_selector={}, tolerations=(),
            autoscaling=None, target=None, acceleration=acceleration,
        )  # fmt: skip

    acceleration = Acceleration.model_validate({"cache": cache}) if cache else None
    made = Stages(
        stages.TextEncodeStage(spec("encode", Role.TEXT_ENCODER), "random-weights", str(device)),
        denoise.SteppedDenoiseStage(
            spec("denoise", Role.DENOISER, acceleration), "random-weights", str(device)
        ),
        stages.DecodeStage(spec("decode", Role.VAE_DECODER), "random-weights", str(device)),
    )

    def count(kind: str, n: int) -> None:
        made.steps[kind] += n

    made.denoise.count_steps = count
    with (
        mock.patch.object(stages, "load_qwen_image", return_value=pipe),
        mock.patch.object(denoise, "load_qwen_image", return_value=pipe),
    ):
        for stage in (made.encode, made.denoise, made.decode):
            stage.load()
    return made


def run_split(
    made: Stages, clock: Clock, n: int, side: int, steps: int
) -> tuple[list[str], dict[str, float], dict[str, float]]:
    """n requests arriving together, as a worker of each stage runs them: each encode,
    the denoising as one batch, each decode. The outputs, each stage's seconds, and each
    stage's peak GPU memory above what was allocated before it (GiB)."""
    from omnipipe.stagekit.stage import StageJob

    params = [
        {"prompt": PROMPT, "negative_prompt": NEGATIVE, "width": side, "height": side,
         "num_inference_steps": steps, "guidance_scale": GUIDANCE, "seed": i}
        for i in range(n)
    ]  # fmt: skip
    seconds: dict[str, float] = {}
    peaks: dict[str, float] = {}

    def timed(name: str, work: Callable[[], Any]) -> Any:
        base = clock.reset_peak()
        start = clock.now()
        result = work()
        seconds[name] = clock.now() - start
        peaks[name] = clock.peak_above(base)
        return result

    encoded = timed("encode", lambda: [made.encode.run(StageJob(p, {})) for p in params])
    denoised = timed(
        "denoise",
        lambda: made.denoise.run_batch(
            [StageJob(p, {"encode": e.tensors}) for p, e in zip(params, encoded, strict=True)]
        ),
    )
    decoded = timed(
        "decode",
        lambda: [
            made.decode.run(StageJob(p, {"denoise": d.tensors}))
            for p, d in zip(params, denoised, strict=True)
        ],
    )
    finite = all(bool(torch.isfinite(d.tensors["latents"]).all()) for d in denoised)
    seconds["latents_finite"] = float(finite)
    return [o["b64_json"] for r in decoded for o in r.outputs], seconds, peaks


def attention_probe(pipe: Any, clock: Clock, side: int, repeats: int) -> dict[str, float]:
    """One denoising step's DiT cost three ways, at this resolution: CFG's two rows as one
    forward with equal text lengths (no mask), as one forward with the negative prompt
    shorter (padded and masked, what the stage runs when lengths differ), and as two
    forwards of one row (the monolith). Milliseconds, medians of `repeats`."""
    transformer = pipe.transformer
    device, dtype = clock.device, transformer.dtype
    scale = pipe.vae_scale_factor
    tokens = (side // scale // 2) ** 2
    text_len, dim = 200, transformer.config.joint_attention_dim
    hidden = torch.randn(2, tokens, transformer.config.in_channels, device=device, dtype=dtype)
    text = torch.randn(2, text_len, dim, device=device, dtype=dtype)
    mask = torch.ones(2, text_len, dtype=torch.long, device=device)
    mask[1, text_len // 2 :] = 0
    shape = (1, side // scale // 2, side // scale // 2)
    times = torch.full((2,), 0.5, device=device, dtype=dtype)

    def forward(rows: slice, with_mask: bool) -> None:
        count = rows.stop - rows.start
        with torch.inference_mode():
            transformer(
                hidden_states=hidden[rows], timestep=times[rows],
                encoder_hidden_states=text[rows],
                encoder_hidden_states_mask=mask[rows] if with_mask else None,
                img_shapes=[[shape]] * count, return_dict=False,
            )  # fmt: skip

    ways: dict[str, Callable[[], None]] = {
        "one_forward_no_mask_ms": lambda: forward(slice(0, 2), False),
        "one_forward_masked_ms": lambda: forward(slice(0, 2), True),
        "two_forwards_ms": lambda: (forward(slice(0, 1), False), forward(slice(1, 2), False)),
    }
    out: dict[str, float] = {}
    for name, way in ways.items():
        way()
        times_ms = []
        for _ in range(repeats):
            start = clock.now()
            way()
            times_ms.append((clock.now() - start) * 1000)
        out[name] = round(sorted(times_ms)[len(times_ms) // 2], 1)
    return out


def cache_settings(steps: int, size: str, threshold: float) -> dict[str, Any]:
    """acceleration.cache as cache-dit's Qwen-Image examples set it: F8B0, 8 warm-up steps."""
    return {"threshold": threshold, "warmupSteps": min(8, steps // 2),
            "firstBlocks": 8 if size == "real" else 1}  # fmt: skip


class Report:
    """Results as they come: each is printed and the whole JSON rewritten, so a run cut
    off by its time limit still leaves what it measured."""

    def __init__(self, path: Path | None, config: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"config": config, "results": {}}

    def add(self, key: str, value: Any) -> None:
        self.data["results"][key] = value
        print(f"{key}: {json.dumps(value)}", flush=True)
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=["real", "tiny"], default="real")
    parser.add_argument("--side", type=int, default=1024, help="image width and height")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="tiny image, few steps")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="skip what is left once this many seconds have passed")  # fmt: skip
    parser.add_argument("--out", type=Path, help="the results as JSON, rewritten as they come")
    parser.add_argument("--cache-threshold", type=float, default=0.08)
    parser.add_argument("--rows", help="comma-separated rows to run, in their order here")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help="default: bfloat16 on a GPU, float32 on the CPU")  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.side, args.steps = 64, 4
    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    clock = Clock(device)
    cache = cache_settings(args.steps, args.size, args.cache_threshold)
    config = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "size": args.size,
        "side": args.side,
        "steps": args.steps,
        "guidance": GUIDANCE,
        "dtype": str(dtype),
        "cache": cache,
    }
    import diffusers
    import transformers

    config["diffusers"], config["transformers"] = diffusers.__version__, transformers.__version__
    report = Report(args.out, config)
    print(json.dumps(config), flush=True)
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"omnipipe-real-size-{os.getpid()}"
    start = clock.now()
    pipe = build_pipeline(args.size, device, dtype, scratch)
    report.add("build_s", round(clock.now() - start, 1))
    report.add(
        "weights_gib",
        {name: weights_gib(getattr(pipe, name)) for name in ("text_encoder", "transformer", "vae")},
    )
    plain = make_stages(pipe, device, cache=None)
    # Warm-up: kernels chosen, workspaces allocated, for both paths, at the same size.
    start = clock.now()
    run_monolith(pipe, 1, args.side, 2)
    run_split(plain, clock, 1, args.side, 2)
    report.add("warmup_s", round(clock.now() - start, 1))

    def within_budget(what: str) -> bool:
        if time.perf_counter() - started < args.budget_s:
            return True
        report.add(f"skipped_{what}", "out of time")
        return False

    per_image: dict[str, float] = {}

    def split_row(name: str, made: Stages, n: int) -> None:
        before = dict(made.steps)
        start = clock.now()
        _, seconds, peaks = run_split(made, clock, n, args.side, args.steps)
        total = clock.now() - start
        per_image[name] = total / n
        steps = {k: made.steps[k] - before[k] for k in made.steps}
        stage_s = {k: round(v, 3) for k, v in seconds.items() if k != "latents_finite"}
        report.add(name, {
            "threshold": made.denoise.cacher.settings.threshold if made.denoise.cacher else None,
            "s_per_image": round(total / n, 2), "request_s": round(total, 2),
            "stage_s": stage_s, "dit_share": round(seconds["denoise"] / total, 3),
            "stage_peak_gib_above_weights": peaks, "request_steps": steps,
            "latents_finite": bool(seconds["latents_finite"]),
        })  # fmt: skip

    def monolith_row(name: str, n: int) -> None:
        start = clock.now()
        run_monolith(pipe, n, args.side, args.steps)
        total = clock.now() - start
        per_image[name] = total / n
        report.add(name, {"s_per_image": round(total / n, 2), "request_s": round(total, 2),
                          "vae_slicing": bool(pipe.vae.use_slicing)})  # fmt: skip

    def guarded(name: str, row: Callable[[], None]) -> None:
        """The row, or what stopped it: one row out of GPU memory leaves the others."""
        if not within_budget(name):
            return
        try:
            row()
        except torch.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            report.add(f"{name}_error", f"out of GPU memory: {str(exc)[:300]}")
            if name.startswith("monolith") and not pipe.vae.use_slicing:
                # The pipeline decodes its whole batch at once; diffusers' own remedy is
                # to decode one image at a time, as the decode stage does.
                pipe.vae.enable_slicing()
                guarded(name, row)

    from omnipipe.api.acceleration import StepCache

    cached: Stages | None = None

    def cache_row(name: str, n: int, settings: dict[str, Any]) -> None:
        nonlocal cached
        if cached is None:
            # cache-dit wraps the shared transformer, which the rows before ran plain.
            cached = make_stages(pipe, device, cache)
        assert cached.denoise.cacher is not None
        cached.denoise.cacher.settings = StepCache.model_validate(settings)
        split_row(name, cached, n)

    # Random weights move the first blocks' residual unlike a trained model's: the
    # default threshold and cache-dit's usual upper one may reuse no step. The last two
    # rows force reuse (threshold 1), every step after the warm-up and every other one,
    # to show what a reused step costs; a trained model's own reuse lies between.
    forced = {**cache_settings(args.steps, args.size, 1.0)}
    rows: dict[str, Callable[[], None]] = {
        "split_c1": lambda: split_row("split_c1", plain, 1),
        "monolith_c1": lambda: monolith_row("monolith_c1", 1),
        "dit_step_probe": lambda: report.add(
            "dit_step_probe", attention_probe(pipe, clock, args.side, 3)
        ),
        "split_c4": lambda: split_row("split_c4", plain, 4),
        "monolith_c4": lambda: monolith_row("monolith_c4", 4),
        "split_cache_c1": lambda: cache_row("split_cache_c1", 1, cache),
        "split_cache_c4": lambda: cache_row("split_cache_c4", 4, cache),
        "split_cache_loose_c1": lambda: cache_row(
            "split_cache_loose_c1", 1, cache_settings(args.steps, args.size, 0.2)
        ),
        "split_cache_forced_all_c1": lambda: cache_row("split_cache_forced_all_c1", 1, forced),
        "split_cache_forced_every_other_c1": lambda: cache_row(
            "split_cache_forced_every_other_c1", 1, {**forced, "maxConsecutiveCachedSteps": 1}
        ),
    }
    chosen = args.rows.split(",") if args.rows else list(rows)
    if unknown := [r for r in chosen if r not in rows]:
        parser.error(f"--rows: no row {', '.join(unknown)}; rows: {', '.join(rows)}")
    # In the table's order, whatever --rows's: the step-cache rows must come after every
    # plain one, since cache-dit's wrapping of the shared transformer stays.
    for name in [r for r in rows if r in chosen]:
        guarded(name, rows[name])
    if "monolith_c1" in per_image:
        # What a server that runs the pipeline one request at a time gives at c4.
        per_image["monolith_one_at_a_time_c4"] = per_image["monolith_c1"]
    ratios = {}
    for anchor_name in ("monolith_c1", "monolith_c4", "monolith_one_at_a_time_c4"):
        c = anchor_name[-1]
        anchor = per_image.get(anchor_name)
        for name in [n for n in per_image if n.startswith("split") and n.endswith(c)]:
            if anchor:
                label = (
                    anchor_name.replace("monolith", "monolith_batched")
                    if c == "4" and "one_at" not in anchor_name
                    else anchor_name
                )
                ratios[f"{name}_time_vs_{label}"] = round(per_image[name] / anchor, 3)
    report.add("ratios", ratios)
    if device.type == "cuda":
        report.add("peak_gib", gib(torch.cuda.max_memory_reserved(device)))
    report.add("total_s", round(time.perf_counter() - started, 1))
    from _common import record

    record("diffusion_real_size", report.data, args.quick)
    print(
        "diffusion_real_size: "
        + " ".join(f"{k}={v}" for k, v in ratios.items())
        + f" total_s={time.perf_counter() - started:.0f}"
    )


if __name__ == "__main__":
    main()
    # The interpreter's collections at exit would walk torch's and diffusers' objects for
    # a second (bench/_common.py's without_exit_collection; this file runs on its own).
    gc.freeze()
