"""Qwen3-Omni's talker as a vLLM model (imported only inside a vLLM engine).

The talker config is vLLM's model config (an `hf_overrides` callable), its text_config
the decoder's: Qwen3-MoE attention (q/k norms, the config's head_dim, interleaved
M-RoPE as transformers' talker always rotates) and a sparse MoE block with a gated
shared expert, as Qwen2-MoE's. Each position's input is its row from the stage (the
projected text, or for the prompt the user turns' rows) plus, from the codec prompt on,
the codec embedding, or where a first code is fed back, its whole frame's embedding
(qwen3_frames.py runs the code predictor for it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.qwen2_moe import Qwen2MoeSparseMoeBlock
from vllm.model_executor.models.qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeDecoderLayer,
    Qwen3MoeModel,
)
from vllm.model_executor.models.utils import PPMissingLayer, maybe_prefix

from omnipipe.families.qwen_omni.vllm.talker_model import FedTalker
from omnipipe.stagekit.vllm.feed import StepFeed
from omnipipe.stagekit.vllm.frames import FrameFeed, fed_inputs


class Qwen3TalkerDecoderLayer(Qwen3MoeDecoderLayer):
    """Qwen3MoeDecoderLayer's forward, with the talker's MoE block (a shared expert)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        self.hidden_size = config.hidden_size
        self.self_attn = Qwen3MoeAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            rope_parameters={**config.rope_parameters, "mrope_interleaved": True},
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=False,
            head_dim=config.head_dim,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = Qwen2MoeSparseMoeBlock(config=config, prefix=f"{prefix}.mlp")  # type: ignore[assignment,arg-type]
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen3OmniTalkerForVllm(FedTalker):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration as CodePredictor,
        )

        config = vllm_config.model_config.hf_config
        text = config.text_config
        self.config = config
        self.model = Qwen3MoeModel(
            vllm_config=vllm_config,
            prefix=maybe_prefix(prefix, "model"),
            decoder_layer_type=Qwen3TalkerDecoderLayer,
        )
        # The codec embedding below is the input; Qwen3MoeModel's own has no weights.
        self.model.embed_tokens = PPMissingLayer()  # type: ignore[no-untyped-call,assignment]
        self.codec_embedding = nn.Embedding(text.vocab_size, text.hidden_size)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.code_predictor = CodePredictor._from_config(
            config.code_predictor_config, dtype=vllm_config.model_config.dtype
        )
        self.feed: StepFeed | None = None
        self.frames: FrameFeed | None = None  # set by the feed when its hook is installed

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        assert input_ids is not None, "the talker takes codec ids, not embeddings"
        codec = self.codec_embedding(input_ids)
        summed, fed = fed_inputs(self.feed, self.frames, codec, input_ids)
        if fed is not None:
            positions = fed
        hidden: torch.Tensor = self.model(None, positions, None, inputs_embeds=summed)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's talker.* tensors (the thinker's and code2wav's are skipped)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        decoder: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if not name.startswith("talker."):
                continue
            name = name.removeprefix("talker.")
            if name == "model.codec_embedding.weight":
                name = "codec_embedding.weight"
            if name.startswith("model."):
                decoder.append((name.removeprefix("model."), tensor))
                continue
            if name.startswith(("text_projection.", "hidden_projection.")):
                continue  # the stage projects the thinker's rows itself
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        loaded |= {f"model.{n}" for n in self.model.load_weights(decoder)}
        return loaded
