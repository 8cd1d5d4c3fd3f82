"""The think stage's KV caches as fixed-size KV blocks for the transfer layer (Message
blocks, received straight into the generate worker's BlockTable).

A block is BLOCK_TOKENS tokens of one context, every layer's keys and values:
(layers, 2, BLOCK_TOKENS, kv_heads, head_dim) in kv_dtype(device), the last block of a
context zero-padded. Both stages work the dtype out from their device: float32 on the
CPU (the engine's dtype there), bfloat16 on a GPU (BAGEL's), so the blocks match the
generate worker's table without a word between them. A small tensor, the layout, says
which context each run of blocks is and how many tokens it holds, in order.
"""

from __future__ import annotations

import torch

from omnipipe.families.bagel.config import LlmShape
from omnipipe.families.bagel.context import FULL, NO_IMAGE, NO_TEXT
from omnipipe.families.bagel.mot import ContextKV

BLOCK_TOKENS = 16
CONTEXTS = (FULL, NO_TEXT, NO_IMAGE)
LAYOUT = "kv_layout"  # int64 (contexts, 2): context index in CONTEXTS, tokens
# Blocks a generate worker's table holds: requests in flight together, at
# BLOCK_TOKENS tokens a block (2048 blocks: 32k tokens of context and companions).
DEFAULT_TABLE_BLOCKS = 2048


def kv_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def block_shape(llm: LlmShape, layers: int) -> tuple[int, ...]:
    return (layers, 2, BLOCK_TOKENS, llm.num_key_value_heads, llm.head_dim)


def block_bytes(llm: LlmShape, layers: int, dtype: torch.dtype) -> int:
    count = 1
    for side in block_shape(llm, layers):
        count *= side
    return count * torch.tensor([], dtype=dtype).element_size()


def pack(
    caches: dict[str, ContextKV], dtype: torch.dtype
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Caches -> blocks (each a contiguous tensor) and their layout."""
    blocks: list[torch.Tensor] = []
    layout = []
    for name, cache in caches.items():
        kv = torch.stack([cache.keys, cache.values], dim=1).to(dtype)  # (L, 2, T, H, D)
        tokens = cache.length
        for start in range(0, tokens, BLOCK_TOKENS):
            part = kv[:, :, start : start + BLOCK_TOKENS]
            block = torch.zeros(
                (*part.shape[:2], BLOCK_TOKENS, *part.shape[3:]), dtype=dtype, device=kv.device
            )
            block[:, :, : part.shape[2]] = part
            blocks.append(block)
        layout.append([CONTEXTS.index(name), tokens])
    return blocks, torch.tensor(layout, dtype=torch.long).reshape(-1, 2)


def unpack(
    rows: list[torch.Tensor],
    layout: torch.Tensor,
    llm: LlmShape,
    layers: int,
    dtype: torch.dtype,
) -> dict[str, ContextKV]:
    """Received block rows (bytes) and the layout -> the caches, copied out of the rows
    (so the rows can go back to the table)."""
    shape = block_shape(llm, layers)
    caches, i = {}, 0
    for index, tokens in layout.tolist():
        count = -(-tokens // BLOCK_TOKENS)
        parts = [rows[j].view(dtype).view(shape) for j in range(i, i + count)]
        i += count
        kv = (
            torch.cat(parts, dim=2)[:, :, :tokens]
            if parts
            else torch.zeros(shape, dtype=dtype)[:, :, :0]
        )
        caches[CONTEXTS[index]] = ContextKV(kv[:, 0].clone(), kv[:, 1].clone())
    if i != len(rows):
        raise ValueError(f"KV layout names {i} blocks, {len(rows)} came")
    return caches
