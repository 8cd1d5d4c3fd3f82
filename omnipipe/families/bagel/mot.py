"""BAGEL's mixture-of-transformers Qwen2: every decoder layer holds two experts of the same
shape, understanding (the plain Qwen2 weights, which vLLM loads) and generation (the
`*_moe_gen` weights, which vLLM skips). Text and ViT tokens go through the understanding
expert; VAE latent tokens through the generation expert. Attention is shared: the
latent tokens attend to the understanding expert's KV cache of the context.

Parameter names follow the checkpoint (`language_model.model.layers.N.self_attn.q_proj`,
`..q_proj_moe_gen`, `mlp_moe_gen`, `norm_moe_gen`), so state_dict() is the checkpoint's
layout and load_state_dict() reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnipipe.families.bagel.config import LlmShape


@dataclass(frozen=True)
class ContextKV:
    """The understanding expert's KV cache of one context, rotary embedding applied to
    the keys (as vLLM caches them): keys and values are (layers, tokens, kv_heads,
    head_dim). A context with no tokens (text-to-image CFG's unconditional branch) is
    a valid, empty cache."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])

    @classmethod
    def empty(cls, llm: LlmShape, layers: int, dtype: torch.dtype) -> ContextKV:
        shape = (layers, 0, llm.num_key_value_heads, llm.head_dim)
        return cls(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype)).to(dtype)


class MLP(nn.Module):
    def __init__(self, llm: LlmShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(llm.hidden_size, llm.intermediate_size, bias=False)
        self.up_proj = nn.Linear(llm.hidden_size, llm.intermediate_size, bias=False)
        self.down_proj = nn.Linear(llm.intermediate_size, llm.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (Qwen2's, and vLLM's for Qwen2): x is
    (tokens, heads, head_dim), positions (tokens,)."""
    dim = x.shape[-1]
    steps = torch.arange(0, dim, 2, dtype=torch.float32, device=x.device)
    inv_freq = 1.0 / (theta ** (steps / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos = torch.cat([freqs.cos(), freqs.cos()], -1)[:, None, :].to(x.dtype)
    sin = torch.cat([freqs.sin(), freqs.sin()], -1)[:, None, :].to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, llm: LlmShape) -> None:
        super().__init__()
        h, d = llm.hidden_size, llm.head_dim
        kv = llm.num_key_value_heads * d
        self.llm = llm
        for suffix in ("", "_moe_gen"):
            setattr(self, f"q_proj{suffix}", nn.Linear(h, llm.num_attention_heads * d))
            setattr(self, f"k_proj{suffix}", nn.Linear(h, kv))
            setattr(self, f"v_proj{suffix}", nn.Linear(h, kv))
            setattr(self, f"o_proj{suffix}", nn.Linear(llm.num_attention_heads * d, h, bias=False))
            if llm.qk_norm:
                setattr(self, f"q_norm{suffix}", RMSNorm(d, llm.rms_norm_eps))
                setattr(self, f"k_norm{suffix}", RMSNorm(d, llm.rms_norm_eps))

    def project(self, x: torch.Tensor, gen: torch.Tensor | None, name: str) -> torch.Tensor:
        """The understanding expert's module for every row, the generation expert's for
        the rows `gen` marks."""
        und: nn.Linear = getattr(self, name)
        out: torch.Tensor = und(x)
        if gen is not None and bool(gen.any()):
            out[gen] = getattr(self, f"{name}_moe_gen")(x[gen])
        return out

    def qkv(
        self, x: torch.Tensor, gen: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        llm = self.llm
        n = x.shape[0]
        q = self.project(x, gen, "q_proj").view(n, llm.num_attention_heads, llm.head_dim)
        k = self.project(x, gen, "k_proj").view(n, llm.num_key_value_heads, llm.head_dim)
        v = self.project(x, gen, "v_proj").view(n, llm.num_key_value_heads, llm.head_dim)
        if llm.qk_norm:
            q, k = self.project(q, gen, "q_norm"), self.project(k, gen, "k_norm")
        return rotary(q, positions, llm.rope_theta), rotary(k, positions, llm.rope_theta), v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> torch.Tensor:
        """q (n, heads, d) over k, v (m, kv_heads, d); causal aligns q with k's tail."""
        llm = self.llm
        groups = llm.num_attention_heads // llm.num_key_value_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        mask = None
        if causal:
            n, m = q.shape[0], k.shape[0]
            mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=m - n)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        return out.transpose(0, 1).reshape(q.shape[0], -1)


class DecoderLayer(nn.Module):
    def __init__(self, llm: LlmShape) -> None:
        super().__init__()
        self.self_attn = Attention(llm)
        self.mlp = MLP(llm)
        self.mlp_moe_gen = MLP(llm)
        self.input_layernorm = RMSNorm(llm.hidden_size, llm.rms_norm_eps)
        self.input_layernorm_moe_gen = RMSNorm(llm.hidden_size, llm.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(llm.hidden_size, llm.rms_norm_eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(llm.hidden_size, llm.rms_norm_eps)

    def expert(self, x: torch.Tensor, gen: torch.Tensor | None, name: str) -> torch.Tensor:
        out: torch.Tensor = getattr(self, name)(x)
        if gen is not None and bool(gen.any()):
            out[gen] = getattr(self, f"{name}_moe_gen")(x[gen])
        return out

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        gen: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the layer's output and this input's own keys and values. With `past`
        (a context's cache) the input attends to all of it and to itself in full, as
        BAGEL's generation query does; without, it is a causal prefill."""
        attn = self.self_attn
        q, k, v = attn.qkv(self.expert(x, gen, "input_layernorm"), gen, positions)
        if past is None:
            mixed = attn.attend(q, k, v, causal=True)
        else:
            mixed = attn.attend(q, torch.cat([past[0], k]), torch.cat([past[1], v]), False)
        x = x + attn.project(mixed, gen, "o_proj")
        x = x + self.expert(self.expert(x, gen, "post_attention_layernorm"), gen, "mlp")
        return x, k, v


class MoTModel(nn.Module):
    def __init__(self, llm: LlmShape) -> None:
        super().__init__()
        self.llm = llm
        self.embed_tokens = nn.Embedding(llm.vocab_size, llm.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(llm) for _ in range(llm.num_hidden_layers))
        self.norm = RMSNorm(llm.hidden_size, llm.rms_norm_eps)
        self.norm_moe_gen = RMSNorm(llm.hidden_size, llm.rms_norm_eps)

    def prefill(self, embeds: torch.Tensor) -> ContextKV:
        """The understanding expert's cache of a context (token or ViT embeddings, in
        order), at positions 0..n-1: what the think stage's engine caches."""
        positions = torch.arange(embeds.shape[0], device=embeds.device)
        keys, values = [], []
        x = embeds
        for layer in self.layers:
            x, k, v = layer(x, positions, None, None)
            keys.append(k)
            values.append(v)
        return ContextKV(torch.stack(keys), torch.stack(values))

    def generate_hidden(
        self, x: torch.Tensor, gen: torch.Tensor, context: ContextKV
    ) -> torch.Tensor:
        """One generation query over a context's cache. BAGEL puts every query token at
        the rotary position right after the context."""
        positions = torch.full((x.shape[0],), context.length, dtype=torch.long, device=x.device)
        for i, layer in enumerate(self.layers):
            past = (context.keys[i].to(x), context.values[i].to(x))
            x, _, _ = layer(x, positions, gen, past)
        out: torch.Tensor = self.norm(x)
        out[gen] = self.norm_moe_gen(x[gen])
        return out


class LanguageModel(nn.Module):
    """`language_model.model` in the checkpoint; lm_head is the understanding side's."""

    def __init__(self, llm: LlmShape) -> None:
        super().__init__()
        self.model = MoTModel(llm)
