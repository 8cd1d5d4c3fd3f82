"""Wan text-to-video split into three stages, reproducing WanPipeline.__call__:
encode (UMT5: the prompt and, under CFG, the negative prompt beside it) -> denoise (the
DiT with true CFG, denoise.py) -> decode (the Wan VAE, frames encoded to H.264 MP4)."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import torch

from omnipipe.families.wan.loading import load_wan
from omnipipe.families.wan.params import MAX_SEQUENCE_LENGTH, video_params
from omnipipe.families.wan.vae_decode import vae_pieces
from omnipipe.stagekit.stage import Stage, StageJob, StageResult, Tensors
from omnipipe.stagekit.video_output import encode_mp4


class WanEncodeStage(Stage):
    """Prompt (and negative prompt, for CFG) -> UMT5 embeddings, cut to their tokens: the
    denoiser pads them back to the context with zeros, as the pipeline does, so a short
    prompt moves its tokens only."""

    def load(self) -> None:
        self.pipe = load_wan(self.model_path, self.device, {"text_encoder", "tokenizer"})

    def text_tokenizer(self) -> Any:
        return self.pipe.tokenizer

    def run(self, job: StageJob) -> StageResult:
        video = video_params(job.params)
        prompts = [video.prompt, *([video.negative_prompt] if video.cfg else [])]
        tokens = self.pipe.tokenizer(
            prompts,
            padding="max_length",
            max_length=MAX_SEQUENCE_LENGTH,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).attention_mask.sum(dim=1)
        with torch.inference_mode():
            embeds, negative = self.pipe.encode_prompt(
                prompt=video.prompt,
                negative_prompt=video.negative_prompt,
                do_classifier_free_guidance=video.cfg,
                max_sequence_length=MAX_SEQUENCE_LENGTH,
                device=self.device,
            )
        out: Tensors = {"prompt_embeds": embeds[:, : int(tokens[0])]}
        if negative is not None:
            out["negative_prompt_embeds"] = negative[:, : int(tokens[1])]
        return StageResult(tensors=out)


class WanDecodeStage(Stage):
    """Latents -> the Wan VAE -> frames -> an MP4, base64 for the router."""

    def load(self) -> None:
        self.pipe = load_wan(self.model_path, self.device, {"vae"})

    def pieces(self, latents: torch.Tensor) -> Generator[torch.Tensor, None, None]:
        """The VAE's output for the latents, (1, 3, frames, height, width) in [-1, 1],
        a latent frame's worth at a time (the first frame, then 4 a piece)."""
        vae = self.pipe.vae
        z = vae.config.z_dim
        latents = latents.to(self.device, vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents)
        yield from vae_pieces(vae, latents / inverse_std + mean)

    def decoded(self, latents: torch.Tensor) -> torch.Tensor:
        """The whole video, as vae.decode returns it (for the equality tests)."""
        return torch.cat(list(self.pieces(latents)), dim=2)

    def frames(self, latents: torch.Tensor) -> np.ndarray:
        """The video's frames, (frames, height, width, 3) floats in [0, 1], as
        WanPipeline(output_type="np") returns them."""
        video = self.decoded(latents)
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")
        return np.asarray(frames[0])

    def run(self, job: StageJob) -> StageResult:
        video = video_params(job.params)
        shape: list[tuple[int, int]] = []

        def frames(pieces: Iterator[torch.Tensor]) -> Iterator[np.ndarray]:
            # Each piece is made, turned to bytes and encoded before the next is made:
            # the float32 video is never held whole (18 GB at the API's largest).
            for piece in pieces:
                self.progress()
                if job.cancelled.is_set():
                    return
                rgb = rgb_frames(piece)
                shape[:] = [(int(rgb.shape[2]), int(rgb.shape[1]))]
                yield from rgb

        # Closed here, on the engine thread, however the encoding ends: the VAE's frame
        # cache is cleared before the next job decodes, not later by the collector.
        with contextlib.closing(self.pieces(job.inputs["denoise"]["latents"])) as pieces:
            mp4, count = encode_mp4(frames(pieces), video.fps, job.cancelled.is_set)
        if job.cancelled.is_set() or count == 0:
            return StageResult()
        [(width, height)] = shape
        return StageResult(
            outputs=[
                {
                    "b64_mp4": base64.b64encode(mp4).decode(),
                    "frames": count,
                    "width": width,
                    "height": height,
                    "fps": video.fps,
                }
            ]
        )


# Frames converted at a time: a piece's float32 frames are held once, not copied whole by
# each of the post-processing steps (they were several times over: 1.2 GB more for 65
# frames at 640x640).
FRAMES_AT_A_TIME = 8


def rgb_frames(video: torch.Tensor) -> np.ndarray:
    """(frames, height, width, 3) uint8 of the VAE's (1, 3, frames, height, width) output
    in [-1, 1]: the values WanPipeline's post-processing (to [0, 1]) then x255, rounded,
    gives, a few frames at a time."""
    _, _, count, height, width = video.shape
    rgb = np.empty((count, height, width, 3), np.uint8)
    with torch.inference_mode():
        for start in range(0, count, FRAMES_AT_A_TIME):
            part = video[0, :, start : start + FRAMES_AT_A_TIME].float()
            unit = (part / 2 + 0.5).clamp(0, 1)
            rgb[start : start + part.shape[1]] = (
                (unit * 255)
                .round()
                .clamp(0, 255)
                .to("cpu", torch.uint8)
                .permute(1, 2, 3, 0)
                .numpy()
            )
    return rgb
