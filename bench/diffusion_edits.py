"""Each image EDIT family's split graph beside diffusers' own pipeline, on the same tiny
checkpoint, input images, seed, output size, steps and guidance: a request's latency
alone (concurrency 1), and the split graph's throughput at concurrency 4 against its own
at 1 (issue #43; bench/diffusion_families.py's rows for text to image).

Targets as there (CPU, tiny sizes): at concurrency 1 the split graph takes at most 1.05x
diffusers' time; at concurrency 4 it gives at least 2x its concurrency-1 throughput.

The inputs are 128x128 noise PNGs (from a seed: a flat picture's near-zero GroupNorm
variance makes the tiny VAE encoders' rounding thread-count dependent). Each row, 8
steps (--quick: 4):
- qwen-image-edit: one input, 128x128 out, true CFG 4 with a negative prompt
  (QwenImageEditPipeline). Its VAE encodes the input at about a megapixel (1024x1024),
  whatever the size asked.
- qwen-image-edit-plus: two inputs, 128x128 out, true CFG 4 (QwenImageEditPlusPipeline);
  each input at about a megapixel for the VAE.
- flux1-kontext: one input, 128x128 out, guidance 2.5 (FluxKontextPipeline, max_area the
  size asked, as omnipipe makes it); the input is encoded at its trained size, 1024x1024.
- flux1-kontext-masked: one input and OpenAI's mask (a transparent 64x64 box), made at
  the input's trained size, 1024x1024 out, as FluxKontextInpaintPipeline makes it (the
  router takes that size or auto, no other): the slowest row by far.
- flux2-edit: tiny://flux2-dev served as pipeline type flux2-edit, two references,
  128x128 out, guidance 4 (Flux2Pipeline(image=[both])); references stay 128x128.

Each row's serve starts while the previous row's stops; diffusers' pipeline runs in this
process, on the same cores, beside its row's idle serve, before that serve is measured.

    .venv/bin/python bench/diffusion_edits.py [--quick] [--families flux1-kontext,flux2-edit]
"""

from __future__ import annotations

import argparse
import io
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import median, record, table, without_exit_collection
from diffusion_families import SIZE, Family, level, started

if TYPE_CHECKING:
    from PIL import Image

    from tests.e2e.conftest import Served

PROMPT = "make it look like a watercolour"
# The inputs' side; the mask's transparent box (OpenAI's: alpha 0 is edited).
INPUT = 128
BOX = (32, 32, 96, 96)
QWEN_CFG = {"guidance_scale": 4.0, "negative_prompt": "blurry"}


@dataclass(frozen=True)
class Edit:
    family: Family  # the served side: model, pipeline type, steps, extra_body's guidance
    pipeline_class: str  # diffusers' class that the checkpoint's edit is
    inputs: int  # input images, each INPUT x INPUT
    # diffusers' own arguments for the family's guidance (Qwen's true CFG scale is its
    # true_cfg_scale; Kontext's max_area is the size asked, as omnipipe makes it).
    reference: dict[str, Any] = field(default_factory=dict)
    masked: bool = False  # made at the input's trained size, whatever size is asked


KONTEXT = Family("tiny://flux1-kontext", "flux-kontext", 8, {"guidance_scale": 2.5})
EDITS = {
    "qwen-image-edit": Edit(
        Family("tiny://qwen-image-edit", "qwen-image-edit", 8, QWEN_CFG),
        "QwenImageEditPipeline",
        1,
        {"true_cfg_scale": 4.0, "negative_prompt": "blurry"},
    ),
    "qwen-image-edit-plus": Edit(
        Family("tiny://qwen-image-edit-plus", "qwen-image-edit-plus", 8, QWEN_CFG),
        "QwenImageEditPlusPipeline",
        2,
        {"true_cfg_scale": 4.0, "negative_prompt": "blurry"},
    ),
    "flux1-kontext": Edit(
        KONTEXT, "FluxKontextPipeline", 1, {"guidance_scale": 2.5, "max_area": SIZE * SIZE}
    ),
    "flux1-kontext-masked": Edit(
        KONTEXT, "FluxKontextInpaintPipeline", 1, {"guidance_scale": 2.5}, masked=True
    ),
    "flux2-edit": Edit(
        Family("tiny://flux2-dev", "flux2-edit", 8, {"guidance_scale": 4.0}),
        "Flux2Pipeline",
        2,
        {"guidance_scale": 4.0},
    ),
}
QUICK = ("qwen-image-edit",)


def out_size(edit: Edit) -> tuple[int, int]:
    """(width, height) of the edit's output: SIZE, or a masked Kontext edit's input's
    trained size."""
    from omnipipe.families.flux.requests import kontext_size

    return kontext_size(INPUT, INPUT) if edit.masked else (SIZE, SIZE)


def inputs(edit: Edit) -> list[Image.Image]:
    """The edit's input pictures: noise, each from its own seed."""
    import numpy as np
    from PIL import Image

    return [
        Image.fromarray(np.random.default_rng(k).integers(0, 256, (INPUT, INPUT, 3), np.uint8))
        for k in range(edit.inputs)
    ]


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def openai_mask() -> bytes:
    """OpenAI's mask: opaque, BOX transparent (edited)."""
    from PIL import Image

    mask = Image.new("RGBA", (INPUT, INPUT), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), BOX)
    return png(mask)


def diffusers_mask() -> Image.Image:
    """The same mask as diffusers reads it: white where it repaints."""
    from PIL import Image

    mask = Image.new("L", (INPUT, INPUT), 0)
    mask.paste(255, BOX)
    return mask


def diffusers_call(edit: Edit, steps: int) -> Callable[[int], None]:
    """The checkpoint's own diffusers edit pipeline, one request at a time."""
    import diffusers
    import torch

    from omnipipe.checkpoints.tiny import resolve_model_path

    cls = getattr(diffusers, edit.pipeline_class)
    pipe: Any = cls.from_pretrained(resolve_model_path(edit.family.model))
    pipe.set_progress_bar_config(disable=True)
    images = inputs(edit)
    arguments: dict[str, Any] = {"image": images if len(images) > 1 else images[0]}
    if edit.masked:  # size: the pipeline's own, the input's trained size
        arguments["mask_image"] = diffusers_mask()
    else:
        arguments["width"], arguments["height"] = out_size(edit)

    def call(i: int) -> None:
        with torch.inference_mode():
            pipe(
                prompt=PROMPT,
                num_inference_steps=steps,
                generator=torch.Generator().manual_seed(i),
                **arguments,
                **edit.reference,
            )

    return call


def served_call(base_url: str, edit: Edit, steps: int) -> Callable[[int], None]:
    """images.edit through the official openai client (multipart, image[] and mask)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="any", max_retries=0, timeout=600)
    [model] = client.models.list().data
    sent = [(f"{k}.png", png(image), "image/png") for k, image in enumerate(inputs(edit))]
    width, height = out_size(edit)
    masked: dict[str, Any] = {"mask": ("mask.png", openai_mask(), "image/png")}
    extra = masked if edit.masked else {}

    def call(i: int) -> None:
        client.images.edit(
            model=model.id,
            image=sent,
            prompt=PROMPT,
            size=f"{width}x{height}",  # type: ignore[arg-type]
            extra_body={"num_inference_steps": steps, "seed": i, **edit.family.call},
            **extra,
        )

    return call


HEADERS = [
    "edit",
    "diffusers ms",
    "split c1 ms",
    "c1 / diffusers",
    "<=1.05x",
    "c1 img/s",
    "c4 img/s",
    "c4 / c1",
    ">=2x",
]


def table_row(name: str, r: dict[str, Any]) -> list[str]:
    return [
        name,
        f"{r['diffusers_s'] * 1e3:.0f}",
        f"{r['split_c1_s'] * 1e3:.0f}",
        f"{r['c1_vs_diffusers']:.2f}x",
        "met" if r["c1_vs_diffusers"] <= 1.05 else "missed",
        f"{r['split_c1_img_per_s']:.2f}",
        f"{r['split_c4_img_per_s']:.2f}",
        f"{r['c4_over_c1']:.2f}x",
        "met" if r["c4_over_c1"] >= 2 else "missed",
    ]


def measured(edit: Edit, served: Served, steps: int, repeats: int, requests: int) -> dict[str, Any]:
    """The row's figures: diffusers' alone, then the serve's at concurrency 1 and 4."""
    reference = diffusers_call(edit, steps)
    reference(0)  # first-call allocations stay out of the figures
    ref_s = median([level(reference, 1, requests)[0] for _ in range(repeats)])
    call = served_call(served.base_url, edit, steps)
    call(0)
    c1 = [level(call, 1, requests) for _ in range(repeats)]
    c4 = [level(call, 4, 4 * requests) for _ in range(repeats)]
    ours_s = median([s for s, _ in c1])
    c1_rps, c4_rps = median([r for _, r in c1]), median([r for _, r in c4])
    width, height = out_size(edit)
    return {
        "diffusers_s": ref_s,
        "split_c1_s": ours_s,
        "c1_vs_diffusers": ours_s / ref_s,
        "split_c1_img_per_s": c1_rps,
        "split_c4_img_per_s": c4_rps,
        "c4_over_c1": c4_rps / c1_rps,
        "steps": steps,
        "inputs": edit.inputs,
        "size": f"{width}x{height}",
    }


def main() -> None:
    from _serves import release

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="qwen-image-edit alone, few requests")
    parser.add_argument("--families", help=f"comma-separated, of: {', '.join(EDITS)}")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    names = args.families.split(",") if args.families else list(QUICK if args.quick else EDITS)
    if unknown := [n for n in names if n not in EDITS]:
        parser.error(f"unknown families: {', '.join(unknown)}")
    repeats = 1 if args.quick else args.repeats
    requests = 1 if args.quick else 4
    steps_of = {
        n: min(EDITS[n].family.steps, 4) if args.quick else EDITS[n].family.steps for n in names
    }
    results = {}
    with (
        tempfile.TemporaryDirectory(prefix="omnipipe-bench-") as work,
        ThreadPoolExecutor(1) as pool,
    ):

        def start(name: str) -> Future[Served]:
            return pool.submit(started, EDITS[name].family, Path(work))

        starting = start(names[0])
        for k, name in enumerate(names):
            edit, steps = EDITS[name], steps_of[name]
            width, height = out_size(edit)
            print(
                f"{name} ({edit.family.model} as {edit.family.pipeline}, {edit.inputs} "
                f"{INPUT}x{INPUT} in, {width}x{height} out, {steps} steps)",
                flush=True,
            )
            served = starting.result()
            try:
                results[name] = measured(edit, served, steps, repeats, requests)
            except BaseException:
                release(served)
                raise
            if k + 1 < len(names):
                starting = start(names[k + 1])
            release(served)
    print(table(HEADERS, [table_row(n, r) for n, r in results.items()]))
    print(f"{INPUT}x{INPUT} inputs, medians of {repeats} repeats of {requests} requests a level")
    record("diffusion_edits", {**results, "input": INPUT, "repeats": repeats}, args.quick)
    print(
        "diffusion_edits: "
        + " ".join(
            f"{n}_c1_vs_diffusers={r['c1_vs_diffusers']:.2f} {n}_c4_over_c1={r['c4_over_c1']:.2f}"
            for n, r in results.items()
        )
    )


if __name__ == "__main__":
    main()
    without_exit_collection()
