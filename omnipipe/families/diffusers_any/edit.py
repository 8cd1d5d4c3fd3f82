"""diffusers-edit: an image edit on a diffusers pipeline run whole (/v1/images/edits, one
input image; with OpenAI's mask, an inpaint), as SGLang Diffusion and vLLM-Omni serve one.

A checkpoint whose class edits images (an img2img or an inpainting pipeline) runs as it
is. A text-to-image one runs as diffusers' AutoPipelineForImage2Image and
AutoPipelineForInpainting map it (StableDiffusion3Pipeline: StableDiffusion3Img2ImgPipeline
and StableDiffusion3InpaintPipeline), the two sharing its weights: a request with a mask
runs the inpainting pipeline, one without the image-to-image one. Requests whose call
settings agree run in one call, each row with its own prompt, input, mask and seeded
generator, so that a row is the image the pipeline makes for its seed alone
(tests/unit/test_diffusers_edit.py). An edit with no size is made at its input's size,
rounded down to a multiple of 16 (edit_requests.edit_size)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from omnipipe.families.diffusers_any.classes import (
    EDIT_TYPE,
    TYPE_FOR_OUTPUT,
    call_arguments,
    refusal,
    type_of,
)
from omnipipe.families.diffusers_any.stage import (
    CallCancelled,
    WholeImagePipeline,
    optional_str,
    rows_of,
)
from omnipipe.families.diffusers_any.usage import cfg_ran, image_usage
from omnipipe.stagekit.masks import decode_mask
from omnipipe.stagekit.media import decode_image
from omnipipe.stagekit.params import int_param, prompt_of
from omnipipe.stagekit.stage import StageInputError, StageJob, refusal_message

TEXT_TO_IMAGE = TYPE_FOR_OUTPUT["images"]
# Call arguments a request sets, by its field; None keeps the pipeline's default.
SETTINGS = ("num_inference_steps", "guidance_scale", "strength")


@dataclass(frozen=True)
class EditRequest:
    """One request's rows: its prompt, input and mask, n images seeded seed, seed + 1..."""

    prompt: str
    negative: str | None
    image: Image.Image
    mask: Image.Image | None
    n: int
    seed: int
    size: tuple[int, int]


class WholeEditStage(WholeImagePipeline):
    """An input image and a prompt (and OpenAI's mask) -> the checkpoint's img2img (or
    inpainting) pipeline -> images in the requested format, base64."""

    serves = EDIT_TYPE

    def pipeline_class(self) -> type:
        """The checkpoint's class, refused before any weights are read unless it edits
        images (a text-to-image class is refused in edit_classes, where diffusers maps it
        to none that does)."""
        own = self.checkpoint_class()
        if type_of(own) != TEXT_TO_IMAGE and (why := refusal(own, self.serves)) is not None:
            raise NotImplementedError(f"{self.model_path}: {why}")
        return own

    def edit_classes(self, own: type) -> dict[bool, type]:
        """The class that runs an edit with a mask (True) and one without (False): an
        edit class alone, for what it takes; a text-to-image class's, as AutoPipeline maps
        them."""
        name = own.__name__
        if type_of(own) != TEXT_TO_IMAGE:
            if "image" not in call_arguments(own):
                raise NotImplementedError(
                    f"{self.model_path}: {name} takes no input image (image=) to edit"
                )
            return {"mask_image" in call_arguments(own): own}
        # diffusers' own AutoPipelineFor*.from_pipe read these maps (diffusers 0.42);
        # test_a_text_to_image_checkpoint_edits_as_autopipeline_maps_it holds them.
        from diffusers.pipelines import auto_pipeline as auto

        family = next(
            (k for k, v in auto.AUTO_TEXT2IMAGE_PIPELINES_MAPPING.items() if v is own), ""
        )
        maps = {
            True: auto.AUTO_INPAINT_PIPELINES_MAPPING,
            False: auto.AUTO_IMAGE2IMAGE_PIPELINES_MAPPING,
        }
        found: dict[bool, type] = {masked: m[family] for masked, m in maps.items() if family in m}
        if not found:
            raise NotImplementedError(
                f"{self.model_path}: {name} makes images from text, and diffusers has no "
                "image-to-image or inpainting pipeline for it (AutoPipelineForImage2Image, "
                f"AutoPipelineForInpainting): serve it as pipeline {TEXT_TO_IMAGE}"
            )
        for edit_class in found.values():
            if (why := refusal(edit_class, self.serves)) is not None:
                raise NotImplementedError(f"{self.model_path}: {why}")
        return found

    def load(self) -> None:
        from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

        own = self.pipeline_class()
        classes = self.edit_classes(own)
        # The checkpoint's own pipeline holds every module (what sleep moves to the host).
        self.pipe = self.load_whole(own)
        auto = {True: AutoPipelineForInpainting, False: AutoPipelineForImage2Image}
        self.pipes: dict[bool, Any] = {}
        for masked, edit_class in classes.items():
            pipe = self.pipe if edit_class is own else auto[masked].from_pipe(self.pipe)
            pipe.set_progress_bar_config(disable=True)
            self.pipes[masked] = pipe

    def usage(self, job: StageJob, images: int) -> dict[str, int]:
        """As a text-to-image request's, and its input image, resized to the output's
        size, as many tokens as an output."""
        return image_usage(self.pipe, job.params, self.ran_cfg, images, self.row_tokens, inputs=1)

    def batch_key(self, job: StageJob) -> Hashable | None:
        # Validated in images(): a key never raises (the scheduler reads it unguarded).
        # A request with no size is made at its input's: images() parts those by size.
        params = job.params
        settings = (str(params.get(k)) for k in ("width", "height", *SETTINGS))
        return (params.get("mask") is not None, *settings, bool(params.get("negative_prompt")))

    def pipe_for(self, masked: bool) -> Any:
        pipe = self.pipes.get(masked)
        if pipe is not None:
            return pipe
        name = type(self.pipes[not masked]).__name__
        if masked:
            raise StageInputError(f"mask: {name} edits the whole image and takes no mask", "mask")
        raise StageInputError(
            f"mask: {name} repaints where a mask is transparent: send a mask", "mask"
        )

    def edit_request(self, pipe: Any, job: StageJob) -> EditRequest:
        params = job.params
        images = params.get("images")
        if not isinstance(images, list) or len(images) != 1:
            count = len(images) if isinstance(images, list) else 0
            raise StageInputError(f"image: this pipeline edits one image, got {count}", "image")
        image = decode_image(images[0], "image")
        mask = params.get("mask")
        # The router's: the size asked, or with none the input's (edit_requests.edit_size).
        size = (int_param(params, "width", 0), int_param(params, "height", 0))
        negative = optional_str(params, "negative_prompt")
        if negative is not None and "negative_prompt" not in call_arguments(type(pipe)):
            raise StageInputError(
                f"{type(pipe).__name__} takes no negative prompt", "negative_prompt"
            )
        return EditRequest(
            prompt=prompt_of(params),
            negative=negative,
            image=image,
            mask=None if mask is None else decode_mask(mask, image.size),
            n=int_param(params, "n", 1),
            seed=int_param(params, "seed", 0),
            size=size,
        )

    def _call_arguments(self, pipe: Any, job: StageJob, negative: bool) -> dict[str, Any]:
        """The call's settings, from the batch's first request (the batch shares them),
        as the image stage reads them (stage.py): guidance with a negative prompt is a
        true-CFG pipeline's true_cfg_scale."""
        takes = call_arguments(type(pipe))
        arguments: dict[str, Any] = {}
        for field in SETTINGS:
            value = job.params.get(field)
            if value is None:
                continue
            key = field
            if key == "guidance_scale" and negative and "true_cfg_scale" in takes:
                key = "true_cfg_scale"
            if key not in takes:
                raise StageInputError(f"{type(pipe).__name__} takes no {field}", field)
            arguments[key] = value
        return arguments

    def images(self, jobs: Sequence[StageJob], output_type: str) -> list[list[Any] | None]:
        """Each job's images (PIL, "np" arrays in 0-1, or "latent"), from one call of the
        pipeline; None for a job cancelled meanwhile."""
        pipe = self.pipe_for(jobs[0].params.get("mask") is not None)
        requests = [self.edit_request(pipe, job) for job in jobs]
        negative = requests[0].negative is not None
        arguments = self._call_arguments(pipe, jobs[0], negative)
        # The batch key holds the size: a batch is one size, one call.
        return self._call(pipe, jobs, requests, requests[0].size, arguments, output_type)

    def _call(
        self,
        pipe: Any,
        jobs: Sequence[StageJob],
        requests: Sequence[EditRequest],
        size: tuple[int, int],
        arguments: dict[str, Any],
        output_type: str,
    ) -> list[list[Any] | None]:
        if all(job.cancelled.is_set() for job in jobs):
            return [None] * len(jobs)
        rows = [(r, i) for r in requests for i in range(r.n)]
        width, height = size
        call = {
            **arguments,
            "prompt": [r.prompt for r, _ in rows],
            "generator": [torch.Generator(device="cpu").manual_seed(r.seed + i) for r, i in rows],
            "output_type": output_type,
        }
        # Each input at the output's size, as the pipeline's own preprocess resizes it:
        # one that takes no size (SDXL's img2img) makes its input's.
        call["image"] = [pipe.image_processor.resize(r.image, height, width) for r, _ in rows]
        if "width" in call_arguments(type(pipe)):
            call.update(width=width, height=height)
        if requests[0].mask is not None:
            call["mask_image"] = [r.mask for r, _ in rows]
        if requests[0].negative is not None:
            call["negative_prompt"] = [r.negative for r, _ in rows]
        call.update(self.step_arguments(pipe, jobs))
        try:
            with torch.inference_mode():
                made = list(pipe(**call).images)
        except CallCancelled:
            return [None] * len(jobs)
        except ValueError as exc:
            # diffusers' check_inputs: what the pipeline refuses of a request (a size it
            # cannot make, a strength that leaves no step) is the client's to change.
            raise StageInputError(refusal_message(exc)) from exc
        self.ran_cfg = cfg_ran(pipe, call)
        return rows_of(jobs, [r.n for r in requests], made)
