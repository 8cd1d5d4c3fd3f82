"""Model families: the one registry of pipeline types, filled from the `omnipipe.families`
entry-point group (as vLLM finds out-of-tree models through `vllm.general_plugins`).

A family is a Python object, `Family`, that a package names in its metadata:

    [project.entry-points."omnipipe.families"]
    qwen-image = "omnipipe.families.qwen_image:FAMILY"

omnipipe's own families register exactly so (pyproject.toml); nothing is special-cased.
A family's module is imported by every component (the CRD generator, the operator, the
router), so it imports only `omnipipe.api`: its heavy parts (stage classes, tiny-model
builders, request extensions) are named as "module:attribute" strings and imported only
by the process that runs them. docs/adding-a-family.md is the contract in prose.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

from omnipipe.api.roles import Engine, Role

ENTRY_POINT_GROUP = "omnipipe.families"
# Loads only the families it names (comma-separated), where more are installed.
FAMILIES_ENV = "OMNIPIPE_FAMILIES"
CUSTOM = "custom"
# Every child object is named <pipeline>-<stage> within 63 characters, so the longest
# stage name a family may define fixes how long a pipeline's name may be; a constant, so
# that installing a family never shortens the names of pipelines that already exist.
MAX_STAGE_NAME = 12


@dataclass(frozen=True)
class StageDefaults:
    """A stage as a pipeline type defines it before any user override."""

    name: str
    role: Role
    engine: Engine
    inputs: tuple[str, ...] = ()
    # GPUs per replica for a real model; tiny:// models always run on the CPU.
    gpus: int = 1
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PipelineType:
    name: str
    description: str
    stages: tuple[StageDefaults, ...]
    # Model ids this type serves, for error messages and docs.
    example_models: tuple[str, ...] = ()
    # What a checkpoint of this type says it is: its model_index.json `_class_name`
    # (diffusers) or its config.json `model_type` (transformers).
    checkpoints: tuple[str, ...] = ()
    # Its output stage writes videos (an MP4 a result): the router serves it at
    # /v1/videos, as asynchronous jobs, and not at the image or chat endpoints.
    makes_video: bool = False
    # Its output stage writes generated audio (music, sound): the router serves it at
    # /v1/audio/generate, and not at the image, video or chat endpoints.
    makes_audio: bool = False
    # The optional /v1/audio/speech fields its stages read (SPEECH_FIELDS); a request
    # that sets another is refused by name, not served as if it had not.
    speech_fields: frozenset[str] = frozenset()
    # How many input images an edit of this type takes at most (/v1/images/edits' image
    # fields), for a type that edits (it has a VAE encoder stage).
    max_edit_images: int = 1
    # The roles of its stages that read an edit's input images (its VAE encoder, and its
    # text encoder where that is a vision-language model): the others are not sent them.
    edit_image_roles: frozenset[Role] = frozenset({Role.TEXT_ENCODER, Role.VAE_ENCODER})
    # Whether an edit of this type takes /v1/images/edits' `mask` (OpenAI's: a PNG the
    # size of the first image, its fully transparent pixels where the image is edited),
    # sent with the images to the stages of edit_image_roles. The router refuses a mask
    # by name on every other type.
    takes_mask: bool = False
    # It edits images (/v1/images/edits) though it has no VAE encoder stage, the mark of
    # an edit graph (the fallback's diffusers-edit, whose one stage is the whole pipeline).
    edits: bool = False
    # The Stage class that runs each (role, engine) on a checkpoint of this type, as
    # "module:Class": the checkpoint's own type picks the table, so one pipeline's
    # stages run on a checkpoint of another type with that type's classes.
    stage_classes: Mapping[tuple[Role, Engine], str] = field(default_factory=dict)
    # The catch-all: it runs any diffusers pipeline checkpoint (one with a
    # model_index.json) whole, with its own stage classes whatever type the checkpoint
    # says it is, and serves a diffusers checkpoint that no other type claims. One
    # installed type at most.
    any_diffusers_checkpoint: bool = False
    # The catch-all's: "module:function" from a diffusers pipeline class name (its
    # model_index.json `_class_name`) to the name of the family's type that serves it
    # (the class's output decides: images, videos or audio), for a model named alone.
    type_for_class: str | None = None
    # Request extensions of its own, where its family's (Family.requests) do not fit it.
    requests: str | None = None

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)


# The image-edit graph (Qwen-Image-Edit's, FLUX.1 Kontext's): a prompt encoder and the
# input image's VAE encoder feed the denoiser, then the VAE decodes.
EDIT_STAGES = (
    StageDefaults("encode", Role.TEXT_ENCODER, Engine.TRANSFORMERS),
    StageDefaults("encode-image", Role.VAE_ENCODER, Engine.DIFFUSERS),
    StageDefaults("denoise", Role.DENOISER, Engine.DIFFUSERS, inputs=("encode", "encode-image")),
    StageDefaults("decode", Role.VAE_DECODER, Engine.DIFFUSERS, inputs=("denoise",)),
)


class RequestProblem(ValueError):
    """A request a family's extensions refuse: the router answers 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class RequestExtensions(Protocol):
    """A family's own request fields (the openai client's `extra_body`), checked by the
    router before any stage sees them. `request` is the request's body as the client sent
    it, its extensions included. Each method raises RequestProblem on bad input."""

    # Whether /v1/chat/completions may ask this family for an image (modalities).
    chat_makes_images: bool
    # Optional (read with getattr): the guidance above which the family's CFG runs, so
    # that a negative prompt at or below it is refused; 1 (true CFG's) where unsaid.
    # Optional methods (read with getattr): edit_params(request), stage parameters for
    # /v1/images/edits (from the extension fields in edit_fields); edit_size(width,
    # height), the size of an edit sent with none; masked_edit_size(width, height), the
    # (width, height) a masked edit of a first input of width x height is made at, where
    # its model fixes it (size auto is that size, and another is refused);
    # video_params(request) and audio_params(request), stage parameters for /v1/videos
    # and /v1/audio/generate.

    def image_params(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Stage parameters for /v1/images/generations."""
        ...

    def chat_image_params(
        self, request: Mapping[str, Any], parse_size: Callable[[str], tuple[int, int]]
    ) -> dict[str, Any]:
        """Stage parameters for a chat request that asks for an image; parse_size reads
        a "WIDTHxHEIGHT" as the router's image endpoints do."""
        ...


@dataclass(frozen=True)
class Family:
    """What a model family registers. Strings name "module:attribute" to import lazily."""

    name: str
    description: str
    pipelines: tuple[PipelineType, ...]
    # tiny://NAME -> a function (target directory) that writes that checkpoint.
    tiny_models: Mapping[str, str] = field(default_factory=dict)
    # A RequestExtensions object, for families with request fields of their own.
    requests: str | None = None
    # Set by the registry: the distribution that registered the family.
    package: str = ""

    @property
    def runs(self) -> frozenset[tuple[Role, Engine]]:
        """The (role, engine) pairs some checkpoint of the family has a stage class for."""
        return frozenset(key for p in self.pipelines for key in p.stage_classes)


class FamilyError(RuntimeError):
    """An installed family that cannot be used: omnipipe refuses to start with it."""


def load_attribute(reference: str) -> Any:
    """The object a "module:attribute" string names."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _check(family: Family, where: str, known: Mapping[str, str]) -> None:
    if not isinstance(family, Family):
        raise FamilyError(f"{where}: is {type(family).__name__}, not an omnipipe Family")
    for pipeline in family.pipelines:
        if pipeline.name == CUSTOM:
            raise FamilyError(f"{where}: the pipeline type name {CUSTOM!r} is reserved")
        if pipeline.name in known:
            raise FamilyError(
                f"{where}: pipeline type {pipeline.name!r} is already registered by "
                f"family {known[pipeline.name]!r}"
            )
        for stage in pipeline.stages:
            if len(stage.name) > MAX_STAGE_NAME:
                raise FamilyError(
                    f"{where}: stage {pipeline.name}/{stage.name} is longer than "
                    f"{MAX_STAGE_NAME} characters"
                )
            if (stage.role, stage.engine) not in pipeline.stage_classes:
                raise FamilyError(
                    f"{where}: stage {pipeline.name}/{stage.name} is {stage.role.value} on "
                    f"{stage.engine.value}, which the family does not say it runs (no "
                    f"entry in {pipeline.name}'s stage_classes)"
                )
        for (role, engine), reference in pipeline.stage_classes.items():
            if not _is_reference(reference):
                raise FamilyError(
                    f"{where}: {pipeline.name}'s stage class for {role.value} on "
                    f'{engine.value} is {reference!r}, not a "module:Class" string'
                )


def _is_reference(reference: object) -> bool:
    if not isinstance(reference, str):
        return False
    module, colon, attribute = reference.partition(":")
    return bool(colon and module and attribute.isidentifier())


def _claim(
    owners: dict[str, str], what: str, names: Iterable[str], family: str, where: str
) -> None:
    """Each checkpoint marker and tiny model is one family's: a second claim is refused,
    not settled by which family happens to load first."""
    for name in names:
        if name in owners:
            raise FamilyError(f"{where}: {what} {name!r} is already family {owners[name]!r}'s")
        owners[name] = family


def register(loaded: Iterable[tuple[str, str, Any]]) -> dict[str, Family]:
    """Families by name from (entry-point name, distribution, loaded object), checked."""
    families: dict[str, Family] = {}
    owners: dict[str, str] = {}
    markers: dict[str, str] = {}
    tiny: dict[str, str] = {}
    catch_all: str | None = None  # the family of the one any_diffusers_checkpoint type
    for name, package, family in loaded:
        where = f"family {name!r} (entry point of {package or 'an unnamed package'})"
        _check(family, where, owners)
        if family.name in families:
            raise FamilyError(f"{where}: a family named {family.name!r} is already installed")
        checkpoints = (c for p in family.pipelines for c in p.checkpoints)
        _claim(markers, "checkpoint marker", checkpoints, family.name, where)
        _claim(tiny, "tiny model", family.tiny_models, family.name, where)
        for pipeline in family.pipelines:
            if pipeline.any_diffusers_checkpoint:
                if catch_all is not None:
                    raise FamilyError(
                        f"{where}: {pipeline.name} runs any diffusers checkpoint, which "
                        f"family {catch_all!r}'s pipeline type already does"
                    )
                catch_all = family.name
        families[family.name] = dataclasses.replace(family, package=package)
        owners.update(dict.fromkeys((p.name for p in family.pipelines), family.name))
    return dict(sorted(families.items()))


def _chosen() -> set[str] | None:
    """OMNIPIPE_FAMILIES: the names of the families to load, comma-separated; all when unset."""
    chosen = os.environ.get(FAMILIES_ENV, "").strip()
    return {n.strip() for n in chosen.split(",") if n.strip()} if chosen else None


@functools.cache
def installed_families() -> dict[str, Family]:
    """Every family installed in this environment (or those OMNIPIPE_FAMILIES names), by
    name; read once per process."""
    points = list(entry_points(group=ENTRY_POINT_GROUP))
    chosen = _chosen()
    if chosen is not None:
        if missing := chosen - {p.name for p in points}:
            raise FamilyError(
                f"{FAMILIES_ENV} names {', '.join(sorted(missing))}, which no installed "
                f"package registers; installed: {', '.join(sorted(p.name for p in points))}"
            )
        points = [p for p in points if p.name in chosen]
    loaded = []
    for point in points:
        package = point.dist.name if point.dist is not None else ""
        try:
            family = point.load()
        except Exception as exc:
            raise FamilyError(
                f"family {point.name!r} ({point.value}, from {package}) does not load: {exc}"
            ) from exc
        if isinstance(family, Family) and family.name != point.name:
            raise FamilyError(
                f"entry point {point.name!r} (from {package}) registers a family named "
                f"{family.name!r}: the two names must be the same"
            )
        loaded.append((point.name, package, family))
    return register(loaded)


def load_installed() -> dict[str, Family]:
    """The registry read now, with each family's request extensions imported (light, by
    the contract): a long-running process calls it as it starts, so a broken family
    stops it there, not at the first reconcile or request that needs the family."""
    families = installed_families()
    for family in families.values():
        own = (p.requests for p in family.pipelines)
        for reference in {r for r in (family.requests, *own) if r is not None}:
            try:
                load_attribute(reference)
            except Exception as exc:
                raise FamilyError(
                    f"family {family.name!r} (from {family.package}): its request "
                    f"extensions {reference} do not load: {exc}"
                ) from exc
    return families


def requests_of(pipeline: str) -> str | None:
    """The request extensions of pipeline type `pipeline`: its own, else its family's."""
    family = family_of(pipeline)
    if family is None:
        return None
    own = next((p.requests for p in family.pipelines if p.name == pipeline), None)
    return own or family.requests


def pipeline_types() -> dict[str, PipelineType]:
    """Every installed pipeline type by name, in family order."""
    return {p.name: p for f in installed_families().values() for p in f.pipelines}


def pipeline_type_names() -> tuple[str, ...]:
    return (*pipeline_types(), CUSTOM)


def family_of(pipeline: str) -> Family | None:
    """The family that registered pipeline type `pipeline`."""
    for family in installed_families().values():
        if any(p.name == pipeline for p in family.pipelines):
            return family
    return None


def family_for_checkpoint(kinds: Sequence[str]) -> tuple[Family, PipelineType] | None:
    """The family and pipeline type whose checkpoints say they are one of `kinds`."""
    for kind in kinds:
        for family in installed_families().values():
            for pipeline in family.pipelines:
                if kind in pipeline.checkpoints:
                    return family, pipeline
    return None


def any_diffusers_type() -> tuple[Family, PipelineType] | None:
    """The installed catch-all for diffusers checkpoints (any_diffusers_checkpoint)."""
    for family in installed_families().values():
        for pipeline in family.pipelines:
            if pipeline.any_diffusers_checkpoint:
                return family, pipeline
    return None


def installed_summary() -> str:
    """The installed families and their pipeline types, for error messages."""
    return "; ".join(
        f"{f.name} ({', '.join(p.name for p in f.pipelines)})"
        for f in installed_families().values()
    )
