"""A diffusers text-to-audio pipeline run whole (AudioLDM's, MusicLDM's): the stage of
the fallback's `diffusers-audio` type, served at /v1/audio/generate. Requests whose call
settings agree (length, steps, guidance, whether they have a negative prompt) run in one
call of the pipeline, each row with its own prompt and seeded generator, so a request's
audio is the one the pipeline makes for it alone (tests/unit/test_diffusers_audio.py).
The audio leaves as the speech stages' does: 16-bit PCM for wav and pcm (the router
writes WAV's header), else encoded (stagekit/audio_output.py), at the pipeline's own
sample rate."""

from __future__ import annotations

import base64
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from omnipipe.families.diffusers_any.stage import CallCancelled, WholePipeline, optional_str
from omnipipe.stagekit.audio_output import speech_encoder
from omnipipe.stagekit.media import pcm16
from omnipipe.stagekit.params import int_param, prompt_of
from omnipipe.stagekit.stage import StageInputError, StageJob, StageResult, refusal_message

# The settings a call shares: the stage parameter (the request's field) and the
# pipeline's argument it sets. A setting left unset (None) keeps the pipeline's default.
SETTINGS = {
    "audio_length": "audio_length_in_s",
    "num_inference_steps": "num_inference_steps",
    "guidance_scale": "guidance_scale",
}


def sample_rate_of(pipe: Any) -> int:
    """The rate the pipeline's audio is made at: its vocoder's (AudioLDM, MusicLDM), else
    its waveform VAE's (Stable Audio's Oobleck)."""
    for part in ("vocoder", "vae"):
        rate = getattr(getattr(getattr(pipe, part, None), "config", None), "sampling_rate", None)
        if isinstance(rate, int) and rate > 0:
            return rate
    raise NotImplementedError(f"{type(pipe).__name__} says no sample rate for its audio")


def mono(waveform: np.ndarray) -> np.ndarray:
    """One channel, as the responses' containers hold it: a stereo pipeline's
    (channels, samples) averaged."""
    return waveform.mean(axis=0) if waveform.ndim == 2 else waveform


def refusal_param(message: str) -> tuple[str, str | None]:
    """A pipeline's refusal of a call argument, in the request's words: the message with
    the argument named as the client's field, and that field."""
    for field, argument in SETTINGS.items():
        if argument in message:
            return message.replace(argument, field), field
    return message, None


class WholeAudioStage(WholePipeline):
    """Prompt -> the checkpoint's own diffusers audio pipeline -> the audio, base64, in
    the requested format."""

    serves = "diffusers-audio"

    def load(self) -> None:
        super().load()
        self.sample_rate = sample_rate_of(self.pipe)

    def batch_key(self, job: StageJob) -> Hashable | None:
        # Checked by the router (audio_params): a key never raises.
        params = job.params
        return (*(str(params.get(key)) for key in SETTINGS), bool(params.get("negative_prompt")))

    def _call_arguments(self, job: StageJob) -> dict[str, Any]:
        """The call's settings, from the batch's first request (the batch shares them)."""
        arguments: dict[str, Any] = {}
        for field, argument in SETTINGS.items():
            value = job.params.get(field)
            if value is None:
                continue
            if argument not in self.takes:
                raise StageInputError(f"{type(self.pipe).__name__} takes no {field}", field)
            arguments[argument] = value
        return arguments

    def waveforms(self, jobs: Sequence[StageJob]) -> list[np.ndarray | None]:
        """Each job's waveform (float, -1 to 1, mono), from one call of the pipeline; None
        for a job cancelled meanwhile."""
        prompts = [prompt_of(job.params) for job in jobs]
        negatives = [optional_str(job.params, "negative_prompt") for job in jobs]
        generators = [
            torch.Generator(device="cpu").manual_seed(int_param(job.params, "seed", 0))
            for job in jobs
        ]
        arguments = self._call_arguments(jobs[0])
        if any(n is not None for n in negatives):
            if "negative_prompt" not in self.takes:
                raise StageInputError(
                    f"{type(self.pipe).__name__} takes no negative prompt", "negative_prompt"
                )
            # The batch key keeps requests with and without one apart.
            arguments["negative_prompt"] = [n or "" for n in negatives]
        arguments.update(self.step_arguments(self.pipe, jobs))
        try:
            with torch.inference_mode():
                made = self.pipe(
                    prompt=prompts, generator=generators, output_type="np", **arguments
                ).audios
        except CallCancelled:
            return [None] * len(jobs)
        except ValueError as exc:
            # diffusers' check_inputs: a length shorter than one latent frame, say.
            message, field = refusal_param(refusal_message(exc))
            raise StageInputError(message, field) from exc
        return [
            None if job.cancelled.is_set() else mono(np.asarray(wave, dtype=np.float32))
            for job, wave in zip(jobs, made, strict=True)
        ]

    def encoded(self, job: StageJob, waveform: np.ndarray) -> dict[str, Any]:
        """A job's output: its audio as the request's response_format and speed ask."""
        pcm = pcm16(waveform)
        encoder = speech_encoder(job.params, self.sample_rate)
        data = pcm if encoder is None else encoder.push(pcm) + encoder.finish()
        return {"audio": base64.b64encode(data).decode(), "sample_rate": self.sample_rate}

    def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
        return [
            StageResult(outputs=[] if wave is None else [self.encoded(job, wave)])
            for job, wave in zip(jobs, self.waveforms(jobs), strict=True)
        ]

    def run(self, job: StageJob) -> StageResult:
        return self.run_batch([job])[0]
