"""What a pipeline type serves, asked by its name: the traits the router, the operator
and the local runner read off the installed types (omnipipe.api.families)."""

from __future__ import annotations

from omnipipe.api.families import PipelineType, pipeline_types
from omnipipe.api.roles import Role

# /v1/audio/speech's fields (OpenAI's and vLLM-Omni's) that only some models take: voice
# style, language, cloning from a reference clip, and the first chunk's size.
SPEECH_FIELDS = frozenset(
    {
        "instructions",
        "language",
        "task_type",
        "ref_audio",
        "ref_text",
        "x_vector_only_mode",
        "initial_codec_chunk_frames",
    }
)


def speech_fields(pipeline: str) -> frozenset[str]:
    """The optional speech fields pipeline type `pipeline` takes."""
    kind = pipeline_types().get(pipeline)
    return frozenset() if kind is None else kind.speech_fields


def max_edit_images(pipeline: str) -> int:
    """How many input images an edit on pipeline type `pipeline` takes at most."""
    kind = pipeline_types().get(pipeline)
    return 1 if kind is None else kind.max_edit_images


def edit_image_roles(pipeline: str) -> frozenset[Role]:
    """The roles of the stages that read an edit's input images on pipeline type
    `pipeline` (a custom pipeline's: its encoders)."""
    kind = pipeline_types().get(pipeline)
    return PipelineType.edit_image_roles if kind is None else kind.edit_image_roles


def takes_mask(pipeline: str) -> bool:
    """Whether an edit on pipeline type `pipeline` takes a mask (a custom pipeline's
    does not)."""
    kind = pipeline_types().get(pipeline)
    return kind is not None and kind.takes_mask


def keeps_voices(pipeline: str) -> bool:
    """Whether pipeline type `pipeline` clones voices, so that its routers keep uploaded
    ones (/v1/audio/voices) in their store."""
    return "ref_audio" in speech_fields(pipeline)


def needs_store(pipeline: str) -> bool:
    """Whether a pipeline of this type keeps video jobs or voices in the router's Redis."""
    return makes_video(pipeline) or keeps_voices(pipeline)


def makes_video(pipeline: str) -> bool:
    """Whether pipeline type `pipeline` writes videos (served at /v1/videos as jobs)."""
    kind = pipeline_types().get(pipeline)
    return kind is not None and kind.makes_video


def makes_audio(pipeline: str) -> bool:
    """Whether pipeline type `pipeline` writes generated audio (/v1/audio/generate)."""
    kind = pipeline_types().get(pipeline)
    return kind is not None and kind.makes_audio


def edits(pipeline: str) -> bool:
    """Whether pipeline type `pipeline` says it edits images whatever its stages."""
    kind = pipeline_types().get(pipeline)
    return kind is not None and kind.edits
