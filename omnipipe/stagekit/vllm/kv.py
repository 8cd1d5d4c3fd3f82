"""A vLLM KV connector that exports, per request, the KV cache of its prompt: the
extension point vLLM's disaggregated prefill uses (kv_transfer_config), here taking the
cache out of the think stage's engine for BAGEL's generation stage.

Scheduler side, build_connector_meta() notes which cache slots each step writes for the
prompt of a request whose id starts with EXPORT_PREFIX. Worker side, save_kv_layer()
(called by vLLM after each attention layer) copies those slots out of the paged cache.
The stage takes a finished prefill's cache with take_exported() through collective_rpc;
the engine runs in this process (the "uni" executor), so no copy crosses a process.

The paged layouts read here are PINNED_VLLM's (engines/vllm_tap.py): the CPU backend's
(see read_slots) and the flash-attention layout (2, num_blocks, block_size, kv_heads,
head_dim); the latter is unchecked here (no GPU). tests/unit/test_bagel_kv.py checks the
export against a one-process prefill and fails the day the CPU layout changes.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

EXPORT_PREFIX = "kvx-"
CONNECTOR_NAME = "OmnipipeKVExport"
LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def kv_transfer_config() -> dict[str, Any]:
    """engineArgs' kv_transfer_config that installs this connector."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": __name__,
        "kv_role": "kv_producer",
    }


@dataclass
class _Slots:
    request_id: str
    start: int  # position of the first token these slots hold
    slots: list[int]


@dataclass
class ExportMetadata(KVConnectorMetadata):
    block_size: int
    saves: list[_Slots] = field(default_factory=list)


@dataclass
class _Prompt:
    block_ids: list[int]
    length: int
    done: int  # prompt tokens scheduled so far


@dataclass
class _Saved:
    """A request's exported rows: (start, keys, values) chunks per layer."""

    chunks: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def read_slots(
    kv_layer: torch.Tensor, slots: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (tokens, kv_heads, head_dim) of these slots of a paged layer."""
    blocks, offsets = slots // block_size, slots % block_size
    if kv_layer.dim() == 4:
        # CPU: (num_blocks, kv_heads, block_size, 2 * head_dim) per block and head holds
        # the keys transposed, (head_dim, block_size), then the values, (block_size,
        # head_dim): the layout its attention kernel ("vec" ISA) reads.
        num_blocks, heads, size, double = kv_layer.shape
        dim = double // 2
        flat = kv_layer.reshape(num_blocks, heads, 2 * size * dim)
        key_blocks = flat[..., : size * dim].view(num_blocks, heads, dim, size)
        value_blocks = flat[..., size * dim :].view(num_blocks, heads, size, dim)
        keys = key_blocks[blocks, :, :, offsets]
        values = value_blocks[blocks, :, offsets]
        return keys, values
    # Flash attention: (2, num_blocks, block_size, kv_heads, head_dim).
    return kv_layer[0, blocks, offsets], kv_layer[1, blocks, offsets]


class OmnipipeKVExport(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._prompts: dict[str, _Prompt] = {}
        self._saved: dict[str, _Saved] = {}
        self._lock = threading.Lock()

    # Scheduler side.

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False  # this connector only exports, it never loads

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def _plan(self, meta: ExportMetadata, request_id: str, prompt: _Prompt, scheduled: int) -> None:
        start, end = prompt.done, min(prompt.done + scheduled, prompt.length)
        prompt.done += scheduled
        if end > start:
            bs = self._block_size
            slots = [prompt.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            meta.saves.append(_Slots(request_id, start, slots))
        if prompt.done >= prompt.length:
            self._prompts.pop(request_id, None)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = ExportMetadata(block_size=self._block_size)
        scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if not new.req_id.startswith(EXPORT_PREFIX):
                continue
            prompt = _Prompt(
                list(new.block_ids[0]), len(new.prompt_token_ids or []), new.num_computed_tokens
            )
            self._prompts[new.req_id] = prompt
            self._plan(meta, new.req_id, prompt, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            known = self._prompts.get(request_id)
            if known is None:
                continue
            prompt = known
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if request_id in cached.resumed_req_ids:  # preempted: all blocks anew
                    prompt.block_ids = list(new_blocks[0])
                else:
                    prompt.block_ids.extend(new_blocks[0])
            prompt.done = int(cached.num_computed_tokens[i])
            self._plan(meta, request_id, prompt, scheduled.get(request_id, 0))
        for request_id in scheduler_output.finished_req_ids:
            self._prompts.pop(request_id, None)
        return meta

    # Worker side.

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ExportMetadata) or not meta.saves:
            return
        found = LAYER_INDEX.search(layer_name)
        if found is None:
            return
        layer = int(found.group(1))
        with self._lock:
            for save in meta.saves:
                slots = torch.tensor(save.slots, dtype=torch.long, device=kv_layer.device)
                keys, values = read_slots(kv_layer, slots, meta.block_size)
                saved = self._saved.setdefault(save.request_id, _Saved())
                saved.chunks.setdefault(layer, []).append(
                    (save.start, keys.to("cpu", copy=True), values.to("cpu", copy=True))
                )

    def wait_for_save(self) -> None:
        return None

    def take(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The request's prompt cache as (layers, tokens, kv_heads, head_dim) keys and
        values, and forget it; None if nothing was exported for it."""
        with self._lock:
            saved = self._saved.pop(request_id, None)
        if saved is None or not saved.chunks:
            return None
        keys, values = [], []
        for layer in sorted(saved.chunks):
            ks, vs, length = [], [], 0
            # A preempted request's recompute saves positions again: keep the first.
            for start, k, v in sorted(saved.chunks[layer], key=lambda c: c[0]):
                skip = length - start
                if skip < k.shape[0]:
                    ks.append(k[max(skip, 0) :])
                    vs.append(v[max(skip, 0) :])
                    length = start + k.shape[0]
            keys.append(torch.cat(ks))
            values.append(torch.cat(vs))
        return torch.stack(keys), torch.stack(values)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._saved.pop(request_id, None)


def take_exported(worker: Any, request_id: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Runs inside vLLM's worker (LLMEngine.collective_rpc)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    assert isinstance(connector, OmnipipeKVExport)
    return connector.take(request_id)
