"""What the OpenAI endpoints share: body parsing, model and role checks, per-stage
sampling overrides, and watching for a client that went away."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from omnipipe.api import ResolvedPipeline
from omnipipe.api.families import RequestExtensions, RequestProblem, load_attribute, requests_of
from omnipipe.api.plain_text import shown
from omnipipe.api.spec import Role
from omnipipe.api.stage_spec import Sampling
from omnipipe.router.api.inputs import check_sampling, check_token_range
from omnipipe.router.errors import BadRequest, ModelNotFound

log = logging.getLogger(__name__)
Body = TypeVar("Body", bound=BaseModel)
Result = TypeVar("Result")
Item = TypeVar("Item")


_NO_DOC = object()
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def error_param(loc: Sequence[int | str], missing: bool = False, doc: Any = _NO_DOC) -> str | None:
    """The request field a validation error is about, as the client names it:
    `messages[0].content`. Pydantic's loc also holds the union member it tried
    ("sampling_params_list.list[nullable[dict[str,any]]]"), which is no field: with the
    request document at hand, a part is kept where the document has it (or, last, where
    the error says it is missing); without one, where it is shaped like a field name."""
    text, node = "", doc
    for i, part in enumerate(loc):
        if isinstance(part, int):
            text += f"[{part}]"
            node = node[part] if isinstance(node, list) and 0 <= part < len(node) else None
            continue
        if doc is _NO_DOC:
            if not _FIELD_NAME.fullmatch(part):
                continue
        elif isinstance(node, dict) and part in node:
            node = node[part]
        elif not (i == len(loc) - 1 and missing):
            continue
        text += f".{part}" if text else part
    return text or None


def bad_request(exc: ValidationError, doc: Any = _NO_DOC) -> BadRequest:
    """The first error of exc as the router's 400: the field, then the rule (never the
    value that broke it)."""
    err = exc.errors(include_input=False, include_url=False)[0]
    param = error_param(err["loc"], err["type"] == "missing", doc)
    return BadRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param)


async def parse_body(model: type[Body], request: Request) -> Body:
    raw = await request.body()
    try:
        # Strict: "10" or true is no number in a JSON body (OpenAI's API refuses both).
        body = model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        raise bad_request(exc, doc) from None
    if body.model_extra:
        log.info("ignoring unknown %s fields: %s", model.__name__, sorted(body.model_extra))
    return body


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: <JSON>` and the blank line that ends it."""
    return f"data: {json.dumps(payload)}\n\n".encode()


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's openapi_extra when it parses its body itself: the body's schema, which
    the app's OpenAPI document lists under components/schemas."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def check_model(model: str, model_ids: set[str]) -> None:
    if model not in model_ids:
        raise ModelNotFound(
            f"model {shown(model)} does not exist", param="model", code="model_not_found"
        )


def family_requests(pipeline: ResolvedPipeline) -> RequestExtensions | None:
    """The request extensions of the pipeline's type (its own, or its family's)."""
    reference = requests_of(pipeline.pipeline)
    if reference is None:
        return None
    extensions: RequestExtensions = load_attribute(reference)
    return extensions


# The guidance above which a model's CFG runs, where its family does not say: true CFG's
# (Qwen-Image's, at 1 the negative prediction cancels out).
DEFAULT_CFG_ABOVE = 1.0


def cfg_guidance_above(extensions: RequestExtensions | None) -> float:
    """The guidance above which the family's CFG runs, so that a negative prompt at or
    below it is refused (RequestExtensions.cfg_guidance_above; 1 where unsaid)."""
    return float(getattr(extensions, "cfg_guidance_above", DEFAULT_CFG_ABOVE))


def request_fields(body: BaseModel) -> dict[str, Any]:
    """The body as a family's extensions read it: the fields the client set (not the
    API's defaults, which a family may replace with its model's) and its extensions."""
    return {**body.model_dump(exclude_unset=True), **(body.model_extra or {})}


def chat_makes_images(extensions: RequestExtensions | None) -> bool:
    return extensions is not None and bool(getattr(extensions, "chat_makes_images", False))


def with_family_checks(call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A family extension's parameters, its RequestProblem answered as a 400."""
    try:
        return call()
    except RequestProblem as exc:
        raise BadRequest(exc.message, param=exc.param) from None


def stage_with_role(pipeline: ResolvedPipeline, role: Role) -> str | None:
    return next((s.name for s in pipeline.stages if s.role == role), None)


def sampling_overrides(
    pipeline: ResolvedPipeline, value: list[dict[str, Any] | None] | dict[str, Any] | None
) -> dict[str, dict[str, Any]]:
    """sampling_params_list: one entry per stage in pipeline order (vLLM-Omni's form), or
    an object keyed by stage name. Each entry is checked against the spec's Sampling."""
    if value is None:
        return {}
    names = [s.name for s in pipeline.stages]
    if isinstance(value, list):
        if len(value) > len(names):
            raise BadRequest(
                f"sampling_params_list has {len(value)} entries; the pipeline has "
                f"{len(names)} stages ({', '.join(names)})",
                param="sampling_params_list",
            )
        keyed = {names[i]: entry for i, entry in enumerate(value) if entry is not None}
    else:
        keyed = value
    overrides: dict[str, dict[str, Any]] = {}
    for stage, entry in keyed.items():
        param = f"sampling_params_list.{stage}"
        if stage not in names:
            raise BadRequest(f"{param}: the pipeline has no stage {shown(stage)}", param=param)
        try:
            parsed = Sampling.model_validate(entry, strict=True)
        except ValidationError as exc:
            err = exc.errors(include_input=False)[0]
            where = error_param(err["loc"], err["type"] == "missing", entry)
            field = f"{param}.{where}" if where else param
            raise BadRequest(f"{field}: {err['msg']}", param=field) from None
        overrides[stage] = parsed.model_dump(exclude_none=True)
        check_sampling(overrides[stage], param)
        # The stage's own defaults (spec.stages[].sampling) count too.
        check_token_range({**pipeline.stage(stage).sampling, **overrides[stage]}, param)
    return overrides


async def until_disconnected(request: Request) -> None:
    # Starlette offers no disconnect event for a plain endpoint; polling is the way.
    while not await request.is_disconnected():  # noqa: ASYNC110
        await asyncio.sleep(0.2)


async def unless_disconnected(request: Request, work: Awaitable[Result]) -> Result:
    """work's result; a client that goes away first cancels it (and so every stage)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        log.info("client went away: cancelling %s", request.url.path)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise BadRequest("client disconnected")
    return task.result()


async def after(first: Item | None, rest: AsyncIterator[Item]) -> AsyncIterator[Item]:
    """`first` (read before the status line, see first_output), then the rest."""
    if first is not None:
        yield first
    async for item in rest:
        yield item


async def first_output(outputs: AsyncGenerator[Item]) -> Item | None:
    """Awaited before a streamed response starts, so that a request the stages reject
    (a malformed image, an unknown voice) still gets its 4xx status."""
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        return None
    except BaseException:
        await outputs.aclose()
        raise
