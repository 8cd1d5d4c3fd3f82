"""The thinker of the Qwen Omni families on transformers: it streams text to the router
and, per generated token, the hidden state the talker consumes. The first chunk it sends
also carries the talker's prompt package. What that package and each reply row hold is
the model version's Handoff (qwen25.py, qwen3.py), built from the hidden_states tuple of
transformers' forward; the vLLM thinker (vllm/thinker.py) owns one too, around its own
forward pass. The prompt is the ChatPrompt's (chat_prompt.py), which both engines share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omnipipe.families.qwen_omni.chat_prompt import ChatPrompt, Conversation
from omnipipe.families.qwen_omni.checkpoint import load_qwen3_omni, load_qwen25_omni
from omnipipe.families.qwen_omni.handoff import (
    Handoff,
    layout_kwargs,
    media_layout,
    pick_voice,
)
from omnipipe.families.qwen_omni.qwen3 import Qwen3Handoff
from omnipipe.families.qwen_omni.qwen25 import Qwen25Handoff
from omnipipe.stagekit.chat_media import ChatMedia
from omnipipe.stagekit.media_limits import EffectiveMedia
from omnipipe.stagekit.replies import THINKER_SAMPLING, ReplyText
from omnipipe.stagekit.sampling import Sampling, next_token
from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    StageInputError,
    StageJob,
    StepResult,
    StreamingStage,
    Tensors,
)


def rope_index(thinker: Any) -> Any:
    """The thinker's 3D rope index: on its text model from transformers 5.21, on the thinker
    itself before (vLLM 0.32 pins transformers below 5.20)."""
    return getattr(thinker.model, "get_rope_index", None) or thinker.get_rope_index


class ThinkerStage(StreamingStage):
    """The thinker of Qwen2.5-Omni; Qwen3ThinkerStage is Qwen3-Omni's. A version's stage
    says how its checkpoint loads and which Handoff it hands the talker."""

    handoff_class: type[Handoff] = Qwen25Handoff

    def load(self) -> None:
        from transformers import AutoProcessor

        self.model = self.load_model()
        self.thinker = self.model.thinker
        self.config = self.model.config
        embed = self.thinker.get_input_embeddings()
        # Built-in defaults < the stage's spec.sampling; requests override per session.
        self.sampling = Sampling.from_params(THINKER_SAMPLING, self.spec.sampling)
        processor = AutoProcessor.from_pretrained(self.model_path)
        self.tokenizer = processor.tokenizer
        eos = self.thinker.generation_config.eos_token_id
        if eos is None:
            eos = self.config.thinker_config.text_config.eos_token_id
        self.eos = frozenset([eos] if isinstance(eos, int) else eos)
        self.handoff = self.handoff_class(self.config, embed, self.speakers())
        self.chat = ChatPrompt(processor, self.spec.media, self.context_length)

    def load_model(self) -> Any:
        return load_qwen25_omni(self.model_path, self.device, "thinker")

    def speakers(self) -> dict[str, Any]:
        """The speaker map, which transformers' from_pretrained loads with the model."""
        speakers: dict[str, Any] = self.model.speaker_map
        return speakers

    def preset_voices(self) -> list[str]:
        return self.handoff.voices

    def text_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def processor(self) -> Any:
        return self.chat.processor

    @property
    def media_limits(self) -> EffectiveMedia:
        """The request budget: the spec's limits, else what the processor and context take."""
        return self.chat.media_limits

    @property
    def context_length(self) -> int:
        """Longest prompt plus reply: engineArgs' max_model_len, else the model's own."""
        limit = self.spec.engine_args.get("max_model_len")
        native = int(self.config.thinker_config.text_config.max_position_embeddings)
        return min(int(limit), native) if limit else native

    def prepare(self, job: StageJob) -> None:
        self.chat.prepare(job)

    def conversation(
        self, messages: Any, mm_processor_kwargs: Any = None
    ) -> tuple[Conversation, ChatMedia]:
        """Router messages -> the processor's conversation and its media."""
        return self.chat.conversation(messages, mm_processor_kwargs)

    def open(self, job: StageJob) -> Session:
        return ThinkerSession(self, job)


class Qwen3ThinkerStage(ThinkerStage):
    """The thinker of Qwen3-Omni-MoE."""

    handoff_class = Qwen3Handoff

    def load_model(self) -> Any:
        return load_qwen3_omni(self.model_path, self.device, "thinker")

    def speakers(self) -> dict[str, Any]:
        return {}  # Qwen3-Omni keeps speakers in the config, not in a separate file


class ThinkerSession(Session):
    def __init__(self, stage: ThinkerStage, job: StageJob) -> None:
        params = job.params
        self.stage = stage
        self.want_audio = bool(params.get("audio"))
        if self.want_audio:
            self.voice = pick_voice(params, stage.handoff.voices)
        self.sampling = Sampling.from_params(stage.sampling, params.get("sampling"))
        self.generator = self.sampling.generator(stage.device)
        conversation, media = stage.chat.prepared(job)
        inputs = stage.chat.model_inputs(stage.chat.prompt_text(conversation), media)
        length = int(inputs["input_ids"].shape[1])
        if length >= stage.context_length:
            # Refused before it takes the engine: a prompt past the context would run
            # for minutes and then fail.
            raise StageInputError(
                f"the prompt is {length} tokens; this model's context is "
                f"{stage.context_length} tokens, and the reply needs at least one"
            )
        self.inputs = {k: v.to(stage.device) for k, v in inputs.items()}
        forced = params.get("forced_reply")
        self.forced: list[int] | None = None
        if forced is not None:
            if not isinstance(forced, str) or not forced:
                raise StageInputError("input must be a non-empty string")
            self.forced = stage.tokenizer(forced, add_special_tokens=False).input_ids
        self.cache: Any = None
        self.rope_deltas: torch.Tensor | None = None
        self.generated: list[int] = []
        self.fed = 0
        self.reply = ReplyText(stage.tokenizer, stage.eos)
        self.prompt: Tensors = {}

    @property
    def prompt_length(self) -> int:
        return int(self.inputs["input_ids"].shape[1])

    def _choose(self, logits: torch.Tensor) -> int:
        if self.forced is not None:
            step = len(self.generated)
            return self.forced[step] if step < len(self.forced) else min(self.stage.eos)
        seen = torch.tensor(self.generated, dtype=torch.long, device=logits.device)
        seen = torch.cat([self.inputs["input_ids"][0], seen])
        early = len(self.generated) < self.sampling.min_tokens
        suppress = tuple(self.stage.eos) if early else ()
        return next_token(logits, self.sampling, seen, suppress, self.generator)

    def _delta(self, final: bool) -> list[dict[str, Any]]:
        return self.reply.delta(self.generated, final)

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        with torch.inference_mode():
            return self._decode() if self.generated else self._prefill()

    def _prefill(self) -> StepResult:
        from transformers import DynamicCache

        thinker = self.stage.thinker
        layout = layout_kwargs(media_layout(self.inputs))
        positions, self.rope_deltas = rope_index(thinker)(
            self.inputs["input_ids"],
            layout["image_grid_thw"],
            layout["video_grid_thw"],
            self.inputs["attention_mask"],
            layout["use_audio_in_video"],
            layout["audio_feature_lengths"],
            layout["video_second_per_grid"],
        )
        self.cache = DynamicCache()
        inputs = {k: v for k, v in self.inputs.items() if k != "use_audio_in_video"}
        out = thinker(
            **inputs,
            use_audio_in_video=layout["use_audio_in_video"],
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=self.want_audio,
        )
        if self.want_audio:
            self.prompt = self.stage.handoff.talker_prompt(
                self.inputs, out.hidden_states, self.voice
            )
        self.generated.append(self._choose(out.logits[0, -1]))
        return StepResult(outputs=self._delta(final=False))

    def _finish(self, tensors: Tensors) -> StepResult:
        last = self.generated[-1]
        stopped = last in self.stage.eos or (
            self.forced is not None and len(self.generated) > len(self.forced)
        )
        outputs = self._delta(final=True)
        outputs.append(
            {
                "finish_reason": "stop" if stopped else "length",
                "prompt_tokens": self.prompt_length,
                "completion_tokens": len(self.generated),
            }
        )
        return StepResult(tensors=tensors, outputs=outputs, done=True)

    def _decode(self) -> StepResult:
        last = self.generated[-1]
        stop = last in self.stage.eos or len(self.generated) >= self.sampling.max_tokens
        # The talker cannot start without the first reply token's hidden state, so that
        # token is fed even when it ends the answer.
        if stop and not (self.want_audio and self.fed == 0):
            return self._finish({})
        thinker = self.stage.thinker
        assert self.rope_deltas is not None
        past = self.cache.get_seq_length()
        position = (past + self.rope_deltas).view(1, 1, 1).expand(3, 1, 1)
        out = thinker(
            input_ids=torch.tensor([[last]], device=self.stage.device),
            position_ids=position,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=self.want_audio,
        )
        tensors: Tensors = {}
        if self.want_audio:
            tensors["reply"] = self.stage.handoff.reply_row(out.hidden_states)
            if self.fed == 0:
                tensors.update(self.prompt, first_token_id=torch.tensor([last]))
        self.fed += 1
        if stop:
            return self._finish(tensors)
        self.generated.append(self._choose(out.logits[0, -1]))
        return StepResult(tensors=tensors, outputs=self._delta(final=False))

    def close(self) -> None:
        self.cache = None
