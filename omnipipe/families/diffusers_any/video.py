"""A diffusers text-to-video pipeline run whole, as one stage (diffusers-video): the job's
prompt and settings -> the pipeline's frames -> an MP4 at the job's frame rate, the
result Wan's decode stage gives the router's video runner. Jobs whose call settings
agree (size, frame count, steps, guidance, whether they have a negative prompt) run in
one call of the pipeline, each row with its own prompt and seeded generator, so a job's
video is the one the pipeline makes for it alone (tests/unit/test_diffusers_video.py).
The step callback reports progress and ends the call once all its jobs are cancelled."""

from __future__ import annotations

import base64
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from omnipipe.families.diffusers_any.stage import CallCancelled, WholePipeline, optional_str
from omnipipe.families.diffusers_any.video_requests import DEFAULT_FPS
from omnipipe.stagekit.params import int_param, prompt_of
from omnipipe.stagekit.stage import StageInputError, StageJob, StageResult, refusal_message
from omnipipe.stagekit.video_output import encode_mp4

# Call arguments a job sets; one left None keeps the pipeline's default.
SETTINGS = ("width", "height", "num_frames", "num_inference_steps", "guidance_scale")
# What the router always sends: a pipeline that takes none of one (Latte's video_length,
# Sana-Video's frames) cannot make the video a job asks for.
SHAPE = frozenset({"width", "height", "num_frames"})


class WholeVideoStage(WholePipeline):
    """Prompt -> the checkpoint's own diffusers video pipeline -> an MP4, base64."""

    serves = "diffusers-video"

    def load(self) -> None:
        super().load()
        name = type(self.pipe).__name__
        if missing := SHAPE - self.takes:
            raise NotImplementedError(
                f"{self.model_path}: {name} takes no {', '.join(sorted(missing))}: "
                "/v1/videos sets each"
            )
        # A batch's videos decode one at a time: the VAE's activations over one video
        # are tens of GB at CogVideoX's 720x480 and 49 frames, and would be as many
        # times that as the batch has rows.
        vae: Any = getattr(self.pipe, "vae", None)
        if callable(getattr(vae, "enable_slicing", None)):
            vae.enable_slicing()

    def batch_key(self, job: StageJob) -> Hashable | None:
        # Validated in videos(): a key never raises (the scheduler reads it unguarded).
        params = job.params
        settings = tuple(str(params.get(key)) for key in SETTINGS)
        return (*settings, bool(params.get("negative_prompt")))

    def _call_arguments(self, job: StageJob) -> dict[str, Any]:
        """The call's settings, from the batch's first job (the batch shares them)."""
        arguments: dict[str, Any] = {}
        for key in SETTINGS:
            value = job.params.get(key)
            if value is None:
                continue
            if key not in self.takes:
                raise StageInputError(f"{type(self.pipe).__name__} takes no {key}", key)
            arguments[key] = value
        return arguments

    def videos(self, jobs: Sequence[StageJob]) -> list[np.ndarray | None]:
        """Each job's frames, (frames, height, width, 3) floats in [0, 1] as the pipeline
        makes them with output_type="np", from one call of the pipeline; None for a job
        cancelled meanwhile."""
        prompts = [prompt_of(job.params) for job in jobs]
        negatives = [optional_str(job.params, "negative_prompt") or "" for job in jobs]
        generators = [
            torch.Generator(device="cpu").manual_seed(int_param(job.params, "seed", 0))
            for job in jobs
        ]
        arguments = self._call_arguments(jobs[0])
        if any(negatives):
            if "negative_prompt" not in self.takes:
                raise StageInputError(
                    f"{type(self.pipe).__name__} takes no negative prompt", "negative_prompt"
                )
            arguments["negative_prompt"] = negatives
        arguments.update(self.step_arguments(self.pipe, jobs))
        try:
            with torch.inference_mode():
                made = self.pipe(
                    prompt=prompts, generator=generators, output_type="np", **arguments
                ).frames
        except CallCancelled:
            return [None] * len(jobs)
        except ValueError as exc:
            # diffusers' check_inputs: what the pipeline refuses of a request (a size it
            # cannot make, a prompt too long) is the client's to change.
            raise StageInputError(refusal_message(exc)) from exc
        return [
            None if job.cancelled.is_set() else np.asarray(made[row])
            for row, job in enumerate(jobs)
        ]

    def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
        return [
            StageResult() if frames is None else self._mp4(job, frames)
            for job, frames in zip(jobs, self.videos(jobs), strict=True)
        ]

    def run(self, job: StageJob) -> StageResult:
        return self.run_batch([job])[0]

    def _mp4(self, job: StageJob, frames: np.ndarray) -> StageResult:
        fps = int_param(job.params, "fps", DEFAULT_FPS)

        def rgb() -> Iterator[np.ndarray]:
            # A frame at a time: the uint8 copy of a video is never held whole beside
            # its floats. Rounded as diffusers' own PIL output rounds.
            for frame in frames:
                self.progress()
                if job.cancelled.is_set():
                    return
                yield (frame * 255).round().clip(0, 255).astype(np.uint8)

        mp4, count = encode_mp4(rgb(), fps, job.cancelled.is_set)
        if job.cancelled.is_set() or count == 0:
            return StageResult()
        height, width = int(frames.shape[1]), int(frames.shape[2])
        video = {"frames": count, "width": width, "height": height, "fps": fps}
        return StageResult(outputs=[{"b64_mp4": base64.b64encode(mp4).decode(), **video}])
