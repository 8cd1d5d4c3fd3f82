"""A diffusers pipeline run whole, as one stage: the fallback for a checkpoint that no
family splits. Requests whose call settings agree (size, steps, guidance, whether they
have a negative prompt) run in one call of the pipeline, each row with its own prompt and
its own seeded generator, so a request's images are the ones the pipeline makes for it
alone (tests/unit/test_diffusers_any.py). The pipeline's step callback reports progress
and ends the call once every request of it is cancelled. WholePipeline is what the
fallback's four types share: the checkpoint's class, checked for the type, loaded whole,
and its step callback."""

from __future__ import annotations

import inspect
import logging
from abc import abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from omnipipe.families.diffusers_any.classes import call_arguments, pipeline_class_named, refusal
from omnipipe.families.diffusers_any.usage import cfg_ran, image_usage, row_patches
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
# Call arguments a request sets; the rest keep the pipeline's defaults.
SETTINGS = ("width", "height", "num_inference_steps", "guidance_scale")


def optional_str(params: dict[str, Any], key: str) -> str | None:
    value = params.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise StageInputError(f"{key} must be a string", key)
    return value


class CallCancelled(Exception):
    """Raised by the step callback once every request of a call is cancelled: it ends the
    call at once. A pipeline's own `_interrupt` skips the steps left but still decodes
    (for a video, the VAE's pass over every frame, the costliest piece after the steps),
    and the older pipelines' `callback` has no interrupt at all."""


class WholePipeline(Stage):
    """A checkpoint's own diffusers pipeline, loaded whole, for the fallback's type
    `serves`: a class that another of its types serves is refused naming that type."""

    serves = "diffusers"
    # The last call's row of latent tokens (step_arguments) and whether it ran CFG (set
    # after the call), for usage.
    row_tokens = 0
    ran_cfg = False

    def checkpoint_class(self) -> type:
        """The diffusers class the checkpoint's model_index.json names."""
        name = str(pipeline_config(self.model_path)["_class_name"])
        pipeline_class = pipeline_class_named(name)
        if pipeline_class is None:
            raise NotImplementedError(f"{self.model_path}: diffusers has no pipeline {name!r}")
        return pipeline_class

    def pipeline_class(self) -> type:
        """The checkpoint's pipeline class, refused by its class before any weights are
        read."""
        pipeline_class = self.checkpoint_class()
        if (why := refusal(pipeline_class, self.serves)) is not None:
            raise NotImplementedError(f"{self.model_path}: {why}")
        return pipeline_class

    def load_whole(self, pipeline_class: Any) -> Any:
        """The pipeline, on the stage's device, with its progress bar off."""
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        log.info("loading %s whole on %s as %s", self.model_path, self.device, self.serves)
        pipe: Any = pipeline_class.from_pretrained(self.model_path, dtype=dtype)
        pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def load(self) -> None:
        self.pipe = self.load_whole(self.pipeline_class())
        self.takes = frozenset(inspect.signature(self.pipe.__call__).parameters)

    def step_arguments(self, pipe: Any, jobs: Sequence[StageJob]) -> dict[str, Any]:
        """The call's step callback, as the argument `pipe` takes one: the watchdog's
        progress, each request's step count, and CallCancelled once all of the call's
        requests are cancelled. It also keeps a row's latent tokens, for usage."""
        self.row_tokens, self.ran_cfg = 0, False

        def after_step(index: int, latents: Any) -> None:
            self.progress()
            self.row_tokens = row_patches(pipe, latents)
            # num_timesteps: the step-end pipelines' (after strength cuts an edit's); the
            # older ones leave it to the scheduler.
            steps = int(getattr(pipe, "num_timesteps", 0) or len(pipe.scheduler.timesteps))
            for job in jobs:
                job.on_step(index + 1, steps)
            if all(job.cancelled.is_set() for job in jobs):
                raise CallCancelled

        takes = call_arguments(type(pipe))
        if "callback_on_step_end" in takes:

            def on_step_end(
                caller: Any, index: int, timestep: Any, tensors: dict[str, Any]
            ) -> dict[str, Any]:
                after_step(index, tensors.get("latents"))
                return {}

            return {"callback_on_step_end": on_step_end}

        # The older pipelines' (AudioLDM's, ModelScope's text-to-video): called after a
        # step, every callback_steps.
        def callback(index: int, timestep: Any, latents: Any) -> None:
            after_step(index, latents)

        return {
            "callback": callback,
            **({"callback_steps": 1} if "callback_steps" in takes else {}),
        }


def pipeline_config(model_path: str) -> dict[str, Any]:
    from diffusers import DiffusionPipeline

    config: dict[str, Any] = DiffusionPipeline.load_config(model_path)
    return config


def rows_of(
    jobs: Sequence[StageJob], counts: Sequence[int], made: Sequence[Any]
) -> list[list[Any] | None]:
    """Each job's rows of one call's output, counts[i] rows the i-th job's, in order;
    None for a job cancelled meanwhile."""
    each: list[list[Any] | None] = []
    start = 0
    for job, n in zip(jobs, counts, strict=True):
        each.append(None if job.cancelled.is_set() else list(made[start : start + n]))
        start += n
    return each


class WholeImagePipeline(WholePipeline):
    """A whole pipeline whose requests' results are its images, each encoded as the
    request asked (PNG, JPEG or WebP, base64)."""

    @abstractmethod
    def images(self, jobs: Sequence[StageJob], output_type: str) -> list[list[Any] | None]:
        """Each job's images, from one call of the pipeline; None for a job cancelled."""

    def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
        return [
            StageResult(
                outputs=[encoded_image(i, job.params) for i in images or ()],
                usage=self.usage(job, len(images)) if images else {},
            )
            for job, images in zip(jobs, self.images(jobs, "pil"), strict=True)
        ]

    def usage(self, job: StageJob, images: int) -> dict[str, int]:
        """What the last call counted of `job`, which got `images` of its images (the
        checkpoint's own pipeline holds the tokenizer every pipeline of it shares)."""
        return image_usage(self.pipe, job.params, self.ran_cfg, images, self.row_tokens)

    def run(self, job: StageJob) -> StageResult:
        return self.run_batch([job])[0]


class WholePipelineStage(WholeImagePipeline):
    """Prompt -> the checkpoint's own diffusers pipeline -> images in the requested
    format, base64."""

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
        arguments.update(self.step_arguments(self.pipe, jobs))
        try:
            with torch.inference_mode():
                made = list(
                    self.pipe(
                        prompt=prompts, generator=generators, output_type=output_type, **arguments
                    ).images
                )
        except CallCancelled:
            return [None] * len(jobs)
        except ValueError as exc:
            # diffusers' check_inputs: what the pipeline refuses of a request (a size it
            # cannot make, a prompt too long) is the client's to change.
            raise StageInputError(refusal_message(exc)) from exc
        self.ran_cfg = cfg_ran(self.pipe, arguments)
        return rows_of(jobs, counts, made)
