"""A diffusers pipeline run whole, as one stage: the fallback for a checkpoint that no
family splits. Requests whose call settings agree (size, steps, guidance, whether they
have a negative prompt) run in one call of the pipeline, each row with its own prompt and
its own seeded generator, so a request's images are the ones the pipeline makes for it
alone (tests/unit/test_diffusers_any.py). The pipeline's step callback reports progress
and stops the loop once every request of the call is cancelled."""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from omnipipe.stagekit.image_output import encoded_image
from omnipipe.stagekit.params import int_param, prompt_of
from omnipipe.stagekit.stage import (
    Stage,
    StageInputError,
    StageJob,
    StageResult,
    refusal_message,
)

log = logging.getLogger(__name__)
# What a pipeline's output dataclass holds, by the field that holds it.
OUTPUT_FIELDS = {"images": "images", "frames": "videos", "audios": "audio"}
# Call arguments a request sets; the rest keep the pipeline's defaults.
SETTINGS = ("width", "height", "num_inference_steps", "guidance_scale")
# What an image-to-image pipeline takes beside the prompt, by argument and by class name
# (diffusers' own naming: StableDiffusion3Img2ImgPipeline, FluxInpaintPipeline, ...).
IMAGE_INPUTS = frozenset({"image", "mask_image", "control_image"})
IMAGE_INPUT_NAMES = ("Img2Img", "Inpaint", "ControlNet", "Edit")


def output_kind(pipeline_class: type) -> str | None:
    """What a pipeline class makes ("images", "videos" or "audio"), by the fields of the
    output dataclasses its module defines or imports (diffusers' `BaseOutput`s:
    StableDiffusion3PipelineOutput.images, WanPipelineOutput.frames,
    AudioPipelineOutput.audios); None where they do not say one thing."""
    from diffusers.utils.outputs import BaseOutput

    module = sys.modules[pipeline_class.__module__]
    kinds = {
        OUTPUT_FIELDS[name]
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, BaseOutput) and value is not BaseOutput
        for name in getattr(value, "__dataclass_fields__", {})
        if name in OUTPUT_FIELDS
    }
    return kinds.pop() if len(kinds) == 1 else None


def refusal(pipeline_class: type) -> str | None:
    """Why the fallback cannot serve a pipeline class on the image API, if it cannot: it
    makes no images, it needs an input image (img2img, inpainting, ControlNet and edit
    pipelines take `image` and the like, which a prompt alone does not give), or it has
    no step callback (its steps could be neither watched nor cancelled)."""
    name = pipeline_class.__name__
    kind = output_kind(pipeline_class)
    if kind != "images":
        return (
            f"{name} makes {kind or 'an output omnipipe cannot tell'}; the diffusers pipeline "
            "serves image pipelines (POST /v1/images/generations)"
        )
    takes = set(inspect.signature(pipeline_class.__call__).parameters)
    if missing := {"prompt", "generator", "output_type"} - takes:
        return (
            f"{name} takes no {', '.join(sorted(missing))}: it does not make images from a prompt"
        )
    if IMAGE_INPUTS & takes or any(word in name for word in IMAGE_INPUT_NAMES):
        return f"{name} needs an input image: the diffusers pipeline serves text to image"
    if "callback_on_step_end" not in takes:
        return f"{name} has no step callback: its steps could not be watched or cancelled"
    return None


def optional_str(params: dict[str, Any], key: str) -> str | None:
    value = params.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise StageInputError(f"{key} must be a string", key)
    return value


class WholePipelineStage(Stage):
    """Prompt -> the checkpoint's own diffusers pipeline -> images in the requested
    format, base64."""

    def load(self) -> None:
        import diffusers
        from diffusers import DiffusionPipeline

        # Refused by its class, before any weights are read.
        name = str(DiffusionPipeline.load_config(self.model_path)["_class_name"])
        pipeline_class = getattr(diffusers, name, None)
        if not isinstance(pipeline_class, type):
            raise NotImplementedError(f"{self.model_path}: diffusers has no pipeline {name!r}")
        if (why := refusal(pipeline_class)) is not None:
            raise NotImplementedError(f"{self.model_path}: {why}")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        log.info("loading %s whole on %s", self.model_path, self.device)
        pipe: Any = DiffusionPipeline.from_pretrained(self.model_path, dtype=dtype)
        pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe
        self.takes = frozenset(inspect.signature(pipe.__call__).parameters)

    def batch_key(self, job: StageJob) -> Hashable | None:
        # Validated in images(): a key never raises (the scheduler reads it unguarded).
        params = job.params
        settings = tuple(str(params.get(key)) for key in SETTINGS)
        return (*settings, bool(params.get("negative_prompt")))

    def _call_arguments(self, job: StageJob, negative: bool) -> dict[str, Any]:
        """The call's settings, from the batch's first request (the batch shares them);
        a setting the client left unset (None) keeps the pipeline's default. A pipeline
        with true CFG (true_cfg_scale beside a distilled guidance_scale: Qwen-Image,
        FLUX.1) takes a request's guidance as its true CFG scale where the request has a
        negative prompt, as the image API means it."""
        arguments: dict[str, Any] = {}
        for key in SETTINGS:
            value = job.params.get(key)
            if value is None:
                continue
            if key == "guidance_scale" and negative and "true_cfg_scale" in self.takes:
                key = "true_cfg_scale"
            if key not in self.takes:
                raise StageInputError(f"{type(self.pipe).__name__} takes no {key}", key)
            arguments[key] = value
        return arguments

    def images(self, jobs: Sequence[StageJob], output_type: str) -> list[list[Any] | None]:
        """Each job's images (PIL, or "np" arrays in 0-1), from one call of the pipeline;
        None for a job cancelled meanwhile."""
        prompts: list[str] = []
        negatives: list[str] = []
        generators: list[torch.Generator] = []
        counts = []
        for job in jobs:
            n = int_param(job.params, "n", 1)
            seed = int_param(job.params, "seed", 0)
            prompts += [prompt_of(job.params)] * n
            negative = optional_str(job.params, "negative_prompt")
            if negative is not None:
                if "negative_prompt" not in self.takes:
                    raise StageInputError(
                        f"{type(self.pipe).__name__} takes no negative prompt", "negative_prompt"
                    )
                negatives += [negative] * n
            generators += [torch.Generator(device="cpu").manual_seed(seed + i) for i in range(n)]
            counts.append(n)
        arguments = self._call_arguments(jobs[0], bool(negatives))
        if negatives:
            arguments["negative_prompt"] = negatives
        arguments["callback_on_step_end"] = self._on_step_end(jobs)
        try:
            with torch.inference_mode():
                made = list(
                    self.pipe(
                        prompt=prompts, generator=generators, output_type=output_type, **arguments
                    ).images
                )
        except ValueError as exc:
            # diffusers' check_inputs: what the pipeline refuses of a request (a size it
            # cannot make, a prompt too long) is the client's to change.
            raise StageInputError(refusal_message(exc)) from exc
        each: list[list[Any] | None] = []
        for job, n in zip(jobs, counts, strict=True):
            mine, made = made[:n], made[n:]
            each.append(None if job.cancelled.is_set() else mine)
        return each

    def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
        return [
            StageResult(outputs=[encoded_image(i, job.params) for i in images or ()])
            for job, images in zip(jobs, self.images(jobs, "pil"), strict=True)
        ]

    def run(self, job: StageJob) -> StageResult:
        return self.run_batch([job])[0]

    def _on_step_end(self, jobs: Sequence[StageJob]) -> Any:
        """The pipeline's step callback: the watchdog's progress, each request's step
        count, and the loop interrupted once all are cancelled: the pipelines' own `_interrupt`
        (diffusers 0.42; test_a_call_whose_requests_are_all_cancelled_stops fails the day it
        goes)."""
        pipe = self.pipe

        def on_step_end(
            caller: Any, index: int, timestep: Any, tensors: dict[str, Any]
        ) -> dict[str, Any]:
            self.progress()
            steps = int(getattr(caller, "num_timesteps", 0) or 0)
            for job in jobs:
                job.on_step(index + 1, steps)
            if all(job.cancelled.is_set() for job in jobs):
                pipe._interrupt = True
            return {}

        return on_step_end
