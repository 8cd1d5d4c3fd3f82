"""Qwen2.5-Omni's talker as a vLLM model (imported only inside a vLLM engine).

The talker config (not the whole omni config) is vLLM's model config, through an
`hf_overrides` callable, so vocab, widths and layers are the talker's. Each position's
input is the thinker's row (embedding_size wide) plus, from the codec prompt's pad and
bos positions on, the codec embedding of its token id, then thinker_to_talker_proj into
the decoder, as transformers' Qwen2_5OmniTalkerForConditionalGeneration does. Rows and
3-D positions come from the stage through the row feed (stagekit/vllm/feed.py).

vLLM's Qwen2 attention takes head_dim as hidden_size / heads; the released talker's is
not (896 / 12 heads, head_dim 64), so the attention here reads the config's head_dim.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.qwen2 import (
    Qwen2Attention,
    Qwen2DecoderLayer,
    Qwen2MLP,
    Qwen2Model,
)
from vllm.model_executor.models.utils import PPMissingLayer, maybe_prefix

from omnipipe.families.qwen_omni.vllm.talker_model import FedTalker
from omnipipe.stagekit.vllm.feed import StepFeed


class TalkerAttention(Qwen2Attention):
    """Qwen2Attention's forward with the config's head_dim."""

    def __init__(self, config: Any, cache_config: CacheConfig | None, prefix: str) -> None:
        nn.Module.__init__(self)
        if get_tensor_model_parallel_world_size() != 1:
            raise ValueError("the vLLM talker runs on one device (no tensor parallelism)")
        self.hidden_size = config.hidden_size
        self.total_num_heads = self.num_heads = config.num_attention_heads
        self.total_num_kv_heads = self.num_kv_heads = config.num_key_value_heads
        self.head_dim = int(config.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.dual_chunk_attention_config = None
        self.qk_norm = False
        self.qkv_proj = QKVParallelLinear(
            self.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=True,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.q_size, self.hidden_size, bias=False, prefix=f"{prefix}.o_proj"
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            prefix=f"{prefix}.attn",
        )


class TalkerDecoderLayer(Qwen2DecoderLayer):
    """Qwen2DecoderLayer's forward around TalkerAttention."""

    def __init__(
        self,
        config: Any,
        cache_config: CacheConfig | None = None,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        nn.Module.__init__(self)
        if getattr(config, "use_sliding_window", False):
            raise ValueError("the vLLM talker does not run sliding-window attention")
        self.hidden_size = config.hidden_size
        self.self_attn = TalkerAttention(config, cache_config, f"{prefix}.self_attn")
        self.mlp = Qwen2MLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen25OmniTalkerForVllm(FedTalker):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.codec_embedding = nn.Embedding(config.vocab_size, config.embedding_size)
        self.thinker_to_talker_proj = nn.Linear(config.embedding_size, config.hidden_size)
        self.model = Qwen2Model(
            vllm_config=vllm_config,
            prefix=maybe_prefix(prefix, "model"),
            decoder_layer_type=TalkerDecoderLayer,
        )
        # The codec embedding above is the input; Qwen2Model's own has no weights.
        self.model.embed_tokens = PPMissingLayer()  # type: ignore[no-untyped-call,assignment]
        self.codec_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.feed: StepFeed | None = None

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        assert input_ids is not None, "the talker takes codec ids, not embeddings"
        feed = self.feed
        codec = self.codec_embedding(input_ids)
        if feed is None:  # vLLM's profile and warm-up runs
            rows, add, positions = torch.zeros_like(codec), None, positions
        else:
            rows, add, positions = feed.rows.to(codec.dtype), feed.add_codec, feed.positions
        summed = rows + (codec if add is None else torch.where(add[:, None], codec, 0.0))
        hidden: torch.Tensor = self.model(
            None, positions, None, inputs_embeds=self.thinker_to_talker_proj(summed)
        )
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's talker.* tensors (the thinker's and token2wav's are skipped)."""
        own = {
            "talker.model.embed_tokens.weight": "codec_embedding.weight",
            "talker.thinker_to_talker_proj.weight": "thinker_to_talker_proj.weight",
            "talker.thinker_to_talker_proj.bias": "thinker_to_talker_proj.bias",
            "talker.codec_head.weight": "codec_head.weight",
        }
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        decoder: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if name in own:
                with torch.no_grad():
                    params[own[name]].copy_(tensor)
                loaded.add(own[name])
            elif name.startswith("talker.model."):
                decoder.append((name.removeprefix("talker.model."), tensor))
        loaded |= {f"model.{n}" for n in self.model.load_weights(decoder)}
        return loaded
