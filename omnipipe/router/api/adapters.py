"""Which LoRA adapter a request applies: the one it names as its model, or the one its
`lora` field names, at the field's scale or the adapter's own."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omnipipe.api import ResolvedPipeline
from omnipipe.api.adapters import MAX_SCALE
from omnipipe.api.plain_text import shown
from omnipipe.api.roles import Role
from omnipipe.router.errors import BadRequest


class LoraRequest(BaseModel):
    """A request's `lora` field: {"name": adapter, "scale": 0.8}."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=63)
    scale: float | None = Field(default=None, ge=0, le=MAX_SCALE)


def lora_param(
    pipeline: ResolvedPipeline, model: str, lora: LoraRequest | None
) -> dict[str, object] | None:
    """The `lora` parameter the adapter's stage gets ({"name", "scale"}), or None for the
    base model."""
    adapters = {a.name: a for a in pipeline.adapters}
    named = adapters.get(model)
    if lora is None:
        return None if named is None else {"name": named.name, "scale": named.scale}
    if lora.name not in adapters:
        have = ", ".join(sorted(adapters)) or "none"
        raise BadRequest(
            f"lora.name: this pipeline has no adapter {shown(lora.name)} (it has: {have})",
            param="lora.name",
        )
    if named is not None and named.name != lora.name:
        raise BadRequest(
            f"model names adapter {shown(named.name)} and lora.name {shown(lora.name)}: name one",
            param="lora.name",
        )
    chosen = adapters[lora.name]
    return {"name": chosen.name, "scale": chosen.scale if lora.scale is None else lora.scale}


def set_stage_lora(
    params: dict[str, dict[str, Any]],
    pipeline: ResolvedPipeline,
    model: str,
    lora: LoraRequest | None,
) -> None:
    """Gives the adapter's own stage (a chat's thinker) the request's `lora` parameter.
    A thinker's adapter applies whole, as vLLM applies it: no other scale."""
    chosen = lora_param(pipeline, model, lora)
    if chosen is None:
        return
    stage = next(a.stage for a in pipeline.adapters if a.name == chosen["name"])
    if stage not in params:
        raise BadRequest(
            f"lora.name: adapter {chosen['name']!r} applies to stage {stage}, which this "
            "request does not run",
            param="lora.name" if lora is not None else "model",
        )
    if pipeline.stage(stage).role is Role.THINKER and chosen["scale"] != 1.0:
        raise BadRequest(
            f"lora.scale: adapter {chosen['name']!r} of the thinker applies whole (scale 1)",
            param="lora.scale",
        )
    params[stage]["lora"] = chosen
