"""/v1/images/edits: OpenAI's image-edit API (a multipart form) on an image-edit stage
graph, with as many input images as its model edits with, and a `mask` where its model
takes one. The router reads each image's header only; the encoders decode them."""

from __future__ import annotations

import base64
import io
import logging
import re
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException

from omnipipe.api.edit import condition_size
from omnipipe.api.families import RequestProblem
from omnipipe.api.pipeline_traits import edit_image_roles, max_edit_images, takes_mask
from omnipipe.api.plain_text import PLAIN_DECIMAL, shown
from omnipipe.router.api.adapters import LoraRequest, lora_param
from omnipipe.router.api.common import (
    bad_request,
    cfg_guidance_above,
    check_model,
    family_requests,
    request_fields,
    with_family_checks,
)
from omnipipe.router.api.images import (
    MAX_IMAGES,
    MAX_SIDE,
    SIZE_MULTIPLE,
    Background,
    ImageFormat,
    ImageGenerationRequest,
    edits_images,
    image_params,
    parse_size,
    respond_with_images,
    response_fields,
)
from omnipipe.router.api.inputs import MAX_EDIT_IMAGE_BYTES, check_edit_image
from omnipipe.router.errors import BadRequest
from omnipipe.router.orchestrator import Orchestrator

log = logging.getLogger(__name__)
# The openai client sends a list of images as `image[]`; one image is `image`.
IMAGE_FIELDS = ("image", "image[]")
MAX_FORM_FIELDS = 32
# Files a form may carry: more than any model edits with (FLUX.2 dev: 10), so that one
# over a model's limit is refused naming the limit.
MAX_FORM_IMAGES = 16
# The openai client sends extra_body's {"lora": {"name": ..., "scale": ...}} in a form as
# the fields lora[name] and lora[scale].
LORA_FIELD = re.compile(r"lora\[(\w+)\]")


class ImageEditRequest(BaseModel):
    """The multipart form's fields. Lenient: unknown fields are accepted and logged."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    image: list[Annotated[bytes, Field(max_length=MAX_EDIT_IMAGE_BYTES)]] = Field(
        min_length=1, max_length=MAX_FORM_IMAGES
    )
    """The images to edit (image, or image[] for several): PNG, JPEG or WebP files, each
    at most 4096x4096 pixels; as many as the model edits with (one for Qwen-Image-Edit,
    up to three for Qwen-Image-Edit-Plus, four for FLUX.2 klein, ten for FLUX.2 dev)."""
    prompt: str = Field(min_length=1, max_length=32_000)
    n: int = Field(default=1, ge=1, le=MAX_IMAGES)
    size: str = Field(default="auto", examples=["auto", "1024x1024"])
    """WIDTHxHEIGHT (sides multiples of 16 from 16 to 2048), or auto: the (last) input's
    aspect ratio at about a megapixel."""
    response_format: str = "b64_json"
    output_format: ImageFormat = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)
    """0-100, for jpeg and webp: 100 (the default) compresses least."""
    background: Background = "auto"
    negative_prompt: str | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    num_inference_steps: int = Field(default=50, ge=1, le=200)
    guidance_scale: float = Field(default=4.0, ge=0, le=50)
    mask: Annotated[bytes, Field(max_length=MAX_EDIT_IMAGE_BYTES)] | None = None
    """A PNG of the (first) image's size with an alpha channel: its fully transparent
    pixels (alpha 0) are where the image is edited, the rest is kept; for a model that
    takes one (FLUX.1 Kontext)."""
    lora: LoraRequest | None = None
    """A LoRA adapter of the pipeline's, as lora[name] and lora[scale] (or name the
    adapter as the model)."""


def form_body(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra for a route that parses a multipart form itself."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    content = {"multipart/form-data": {"schema": schema}}
    return {"requestBody": {"required": True, "content": content}}


NUMBER_FIELDS = frozenset(
    name
    for name, field in ImageEditRequest.model_fields.items()
    if field.annotation in (int, float, int | None, float | None)
)


async def read_form(request: Request) -> FormData:
    try:
        return await request.form(max_files=MAX_FORM_IMAGES, max_fields=MAX_FORM_FIELDS)
    except HTTPException as exc:  # starlette's word for a malformed multipart body
        raise BadRequest(f"malformed multipart form: {exc.detail}") from None


async def parse_edit(form: FormData) -> ImageEditRequest:
    # In the order sent: "Picture N" and size=auto follow it.
    images = [v for key, v in form.multi_items() if key in IMAGE_FIELDS]
    if not images:
        raise BadRequest("image: a file is required (multipart field image)", param="image")
    files = [image for image in images if isinstance(image, UploadFile)]
    if len(files) < len(images):
        raise BadRequest("image: must be a file part, not a text field", param="image")
    masks = form.getlist("mask")
    mask_files = [m for m in masks if isinstance(m, UploadFile)]
    if len(masks) > 1 or len(mask_files) < len(masks):
        raise BadRequest("mask: must be one file part, a PNG", param="mask")
    fields: dict[str, Any] = {}
    lora: dict[str, str] = {}
    for key in form:
        if key in (*IMAGE_FIELDS, "mask"):
            continue
        values = form.getlist(key)
        if len(values) > 1 or not isinstance(values[0], str):
            raise BadRequest(f"{key}: expected one text field", param=key)
        if part := LORA_FIELD.fullmatch(key):
            lora[part[1]] = values[0]
        else:
            fields[key] = values[0]
    if lora and "lora" in fields:
        # One would be dropped: refused rather than pick for the client.
        raise BadRequest("lora: send lora[name] and lora[scale], or lora, not both", param="lora")
    for key in NUMBER_FIELDS & set(fields):
        if not PLAIN_DECIMAL.fullmatch(fields[key]):
            raise BadRequest(
                f"{key}: must be a plain decimal number, got {shown(fields[key])}", param=key
            )
    raws = [await image.read(MAX_EDIT_IMAGE_BYTES + 1) for image in files]
    mask = {"mask": await mask_files[0].read(MAX_EDIT_IMAGE_BYTES + 1)} if mask_files else {}
    try:
        body = ImageEditRequest.model_validate({**fields, **lora_of(lora), "image": raws, **mask})
    except ValidationError as exc:
        raise bad_request(exc, {**fields, **lora_of(lora)}) from None
    return body


def lora_of(parts: dict[str, str]) -> dict[str, Any]:
    """The lora field from its form parts; a scale read as the other numbers are."""
    if not parts:
        return {}
    scale = parts.get("scale")
    if scale is not None and not PLAIN_DECIMAL.fullmatch(scale):
        raise BadRequest(
            f"lora.scale: must be a plain decimal number, got {shown(scale)}", param="lora.scale"
        )
    return {"lora": parts}


def checked_images(body: ImageEditRequest, most: int) -> list[tuple[int, int]]:
    """Each input's (width, height), from its header; as many inputs as the model takes,
    each of a shape the graph runs (its conditioning size within the sides it takes)."""
    if len(body.image) > most:
        raise BadRequest(
            f"image: model {shown(body.model)} edits with at most {most} input "
            f"image{'s' * (most > 1)}, got {len(body.image)}",
            param="image",
        )
    sizes = []
    for i, raw in enumerate(body.image):
        param = "image" if len(body.image) == 1 else f"image[{i}]"
        width, height = check_edit_image(raw, param)
        cond_w, cond_h = condition_size(width, height)
        for side in (cond_w, cond_h):
            if not SIZE_MULTIPLE <= side <= MAX_SIDE:
                raise BadRequest(
                    f"{param}: {width}x{height} is too far from square (at most 4:1)",
                    param=param,
                )
        sizes.append((width, height))
    return sizes


def edit_size(
    body: ImageEditRequest, extensions: object, width: int, height: int
) -> tuple[int, int]:
    """The output size: the size asked, or auto: the last input's size as its family
    makes it (its extensions' edit_size), else its conditioning size."""
    if body.size != "auto":
        return parse_size(body.size)
    made_at = getattr(extensions, "edit_size", None)
    if made_at is None:
        return condition_size(width, height)
    try:
        made_w, made_h = made_at(width, height)
    except RequestProblem as exc:
        raise BadRequest(exc.message, param=exc.param) from None
    return int(made_w), int(made_h)


def checked_mask(body: ImageEditRequest, kind: str, image: tuple[int, int]) -> str | None:
    """The mask, base64, once its model takes one and its header says it is OpenAI's:
    a PNG with an alpha channel (or PNG transparency) of the first image's size."""
    if body.mask is None:
        return None
    if not takes_mask(kind):
        raise BadRequest(f"mask: model {shown(body.model)} ({kind}) takes no mask", param="mask")
    # Its pixel count and readable header, as an input image's.
    size = check_edit_image(body.mask, "mask")
    from PIL import Image

    with Image.open(io.BytesIO(body.mask)) as mask:
        kind_of = mask.format
        alpha = "A" in mask.getbands() or "transparency" in mask.info
    if kind_of != "PNG":
        raise BadRequest(f"mask: must be a PNG, got {kind_of}", param="mask")
    if not alpha:
        raise BadRequest(
            "mask: the PNG has no alpha channel (its transparent pixels are where the image "
            "is edited)",
            param="mask",
        )
    if size != image:
        raise BadRequest(
            f"mask: {size[0]}x{size[1]}, not the size of the image, {image[0]}x{image[1]}",
            param="mask",
        )
    return base64.b64encode(body.mask).decode()


def masked_edit_size(
    body: ImageEditRequest, extensions: object, image: tuple[int, int]
) -> tuple[int, int] | None:
    """The size of a masked edit whose model fixes it (its family's masked_edit_size, of
    the first input's size): auto is that size, another is refused. None: not fixed."""
    made_at = getattr(extensions, "masked_edit_size", None)
    if made_at is None:
        return None
    try:
        width, height = made_at(*image)
    except RequestProblem as exc:
        raise BadRequest(exc.message, param=exc.param) from None
    if body.size != "auto" and parse_size(body.size) != (width, height):
        raise BadRequest(
            f"size: model {shown(body.model)} makes a masked edit at its input's trained size, "
            f"{width}x{height}: send size=auto or {width}x{height}, got {body.size}",
            param="size",
        )
    return int(width), int(height)


def edits_router(orchestrator: Orchestrator, model_ids: Callable[[], set[str]]) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/images/edits", response_model=None, openapi_extra=form_body(ImageEditRequest))
    async def edit(request: Request) -> Response:
        form = await read_form(request)
        try:
            body = await parse_edit(form)
        finally:
            await form.close()
        check_model(body.model, model_ids())
        if body.response_format != "b64_json":
            raise BadRequest("only response_format=b64_json is supported", param="response_format")
        if not edits_images(orchestrator):
            raise BadRequest(
                f"pipeline {orchestrator.pipeline.name} generates images from text and does "
                "not edit them: use POST /v1/images/generations"
            )
        kind = orchestrator.pipeline.pipeline
        sizes = checked_images(body, max_edit_images(kind))
        mask = checked_mask(body, kind, sizes[0])
        # A family's own defaults and refusals for an edit (FLUX.1 Kontext's).
        extensions = family_requests(orchestrator.pipeline)
        # What the family reads of the form's other fields (diffusers-edit's strength).
        if unread := sorted(
            set(body.model_extra or {}) - getattr(extensions, "edit_fields", set())
        ):
            log.info("ignoring unknown image edit fields: %s", unread)
        masked_size = None if mask is None else masked_edit_size(body, extensions, sizes[0])
        size = masked_size or edit_size(body, extensions, *sizes[-1])
        fields = body.model_dump(exclude={"image", "size", "mask"})
        params = image_params(
            ImageGenerationRequest(**fields), size, cfg_guidance_above(extensions)
        )
        edit_params = getattr(extensions, "edit_params", None)
        if edit_params is not None:
            extra = {k: v for k, v in request_fields(body).items() if k not in ("image", "mask")}
            params.update(with_family_checks(lambda: edit_params(extra)))
        # The adapter the model or the lora field names, for the stage that applies it.
        lora = lora_param(orchestrator.serving_pipeline(), body.model, body.lora)
        if lora is not None:
            params["lora"] = lora
        inputs: dict[str, Any] = {"images": [base64.b64encode(raw).decode() for raw in body.image]}
        if mask is not None:
            inputs["mask"] = mask
        # The stages that read the inputs get them; the rest, the request without them.
        readers = edit_image_roles(kind)
        return await respond_with_images(
            request,
            orchestrator,
            {
                s.name: {**params, **inputs} if s.role in readers else params
                for s in orchestrator.pipeline.stages
            },
            response_fields(params),
        )

    return router
