"""LoRA adapters of a pipeline: each applies to one stage, and clients pick one per
request by naming it as the model (or in a `lora` field, with a scale)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from omnipipe.api.roles import Role
from omnipipe.api.spec_base import DnsLabel, SpecModel

MAX_ADAPTERS = 64
MAX_SCALE = 8.0
# The largest LoRA rank a stage loads (vLLM's own largest max_lora_rank): vLLM sizes its
# buffers for every slot by the largest rank, so one rank-100000 file would take them all.
MAX_LORA_RANK = 512
# The roles whose stages load adapters.
ADAPTER_ROLES = frozenset({Role.DENOISER, Role.THINKER})


class Adapter(SpecModel):
    """One LoRA adapter, loaded into its stage's model as the stage starts."""

    name: DnsLabel
    """The adapter's model id: clients send it as `model`, and /v1/models lists it. It may
    not be the pipeline's own name."""
    source: Annotated[str, Field(min_length=1, max_length=512)]
    """Where its weights are: a directory with a diffusers LoRA file
    (pytorch_lora_weights.safetensors) as the stage's container sees it, or a Hugging Face
    repo id fetched as the model is."""
    stage: DnsLabel
    """The stage it applies to: a denoiser (diffusers LoRA through peft), or a thinker
    run by vLLM (a PEFT adapter of the language model, through vLLM's multi-LoRA)."""
    scale: Annotated[float, Field(ge=0, le=MAX_SCALE)] = 1.0
    """How strongly a denoiser's adapter applies when a request names it as its model; a
    request's `lora` field may set its own. 0 is the model without it. A thinker's adapter
    applies whole (1)."""
