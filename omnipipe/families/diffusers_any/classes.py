"""Which of the fallback's pipeline types serves a diffusers pipeline class, by what the
class makes (its output dataclasses' fields) and what it takes (an input image or not),
and why a type cannot serve a class. diffusers is imported here, inside the functions:
only for a checkpoint that no family claims, which is then served by diffusers anyway."""

from __future__ import annotations

import inspect
import sys
from typing import Any

# What a pipeline's output dataclass holds, by the field that holds it.
OUTPUT_FIELDS = {"images": "images", "frames": "videos", "audios": "audio"}
# The fallback's pipeline type for each output, and for an image pipeline that takes an
# input image (img2img, inpainting: served at /v1/images/edits).
TYPE_FOR_OUTPUT = {"images": "diffusers", "videos": "diffusers-video", "audio": "diffusers-audio"}
EDIT_TYPE = "diffusers-edit"
# What an image-to-image pipeline takes beside the prompt, by argument and by class name
# (diffusers' own naming: StableDiffusion3Img2ImgPipeline, FluxInpaintPipeline, ...).
IMAGE_INPUTS = frozenset({"image", "mask_image", "control_image"})
IMAGE_INPUT_NAMES = ("Img2Img", "Inpaint", "ControlNet", "Edit")
# ... and what a video or audio pipeline that needs more than a prompt takes: the
# fallback's /v1/videos and /v1/audio/generate take text alone.
MEDIA_INPUTS = IMAGE_INPUTS | {"video", "audio", "conditions"}
MEDIA_INPUT_NAMES = (*IMAGE_INPUT_NAMES, "ImageToVideo", "VideoToVideo", "Img2Vid", "I2V")


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


def call_arguments(pipeline_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(pipeline_class.__call__).parameters)


def takes_image(pipeline_class: type) -> bool:
    """Whether the class needs an input image (img2img, inpainting, ControlNet, edits)."""
    name = pipeline_class.__name__
    return bool(IMAGE_INPUTS & call_arguments(pipeline_class)) or any(
        word in name for word in IMAGE_INPUT_NAMES
    )


def type_of(pipeline_class: type) -> str | None:
    """The fallback type that serves the class; None where it makes none of the three."""
    kind = output_kind(pipeline_class)
    if kind == "images" and takes_image(pipeline_class):
        return EDIT_TYPE
    return TYPE_FOR_OUTPUT.get(kind) if kind is not None else None


def pipeline_class_named(name: str) -> type | None:
    import diffusers

    found: Any = getattr(diffusers, name, None)
    return found if isinstance(found, type) else None


def type_for_class(name: str) -> str:
    """The fallback type a model named alone is served as (PipelineType.type_for_class):
    "diffusers" where the class is unknown or makes none of the three, so that its stage
    refuses it at load with the reason."""
    pipeline_class = pipeline_class_named(name)
    found = type_of(pipeline_class) if pipeline_class is not None else None
    return found or "diffusers"


def refusal(pipeline_class: type, serves: str) -> str | None:
    """Why the fallback's type `serves` cannot run a pipeline class, if it cannot: the
    class makes another output or takes an input image (another type serves it, named),
    it needs more than text (a control image; a video or audio pipeline's input), it
    makes nothing from a prompt, or it has no step callback (its steps could be neither
    watched nor cancelled)."""
    name = pipeline_class.__name__
    right = type_of(pipeline_class)
    if right is None:
        kind = output_kind(pipeline_class)
        return (
            f"{name} makes {kind or 'an output omnipipe cannot tell'}; the diffusers "
            "pipelines serve images, videos and audio"
        )
    if "ControlNet" in name or "control_image" in call_arguments(pipeline_class):
        return f"{name} takes a control image: the diffusers fallback serves no ControlNet"
    if right != EDIT_TYPE and (
        MEDIA_INPUTS & call_arguments(pipeline_class)
        or any(word in name for word in MEDIA_INPUT_NAMES)
    ):
        return f"{name} needs an input image, video or clip: {right} makes its output from text"
    if right != serves:
        makes = "edits images" if right == EDIT_TYPE else f"makes {output_kind(pipeline_class)}"
        return f"{name} {makes}: serve it as pipeline {right}, not {serves}"
    takes = call_arguments(pipeline_class)
    if missing := {"prompt", "generator", "output_type"} - takes:
        return f"{name} takes no {', '.join(sorted(missing))}: it makes nothing from a prompt"
    # callback: the older pipelines' (AudioLDM's, Stable Audio's), called after each step.
    if not {"callback_on_step_end", "callback"} & takes:
        return f"{name} has no step callback: its steps could not be watched or cancelled"
    return None
