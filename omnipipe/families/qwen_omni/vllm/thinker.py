"""The Qwen Omni thinkers on vLLM: the production engine for the thinker role.

One LLMEngine per worker runs every open request of the stage in one continuous batch.
Each session adds its request to the engine; a session's step runs engine steps (which
advance every request) until its own request has something new, so N open sessions cost
one engine step per round, not N. Prompts go through vLLM's own multimodal processing.

What the talker gets is built by the model version's Handoff (qwen25.py, qwen3.py), the
same object the transformers thinker owns, from the layers it names read off vLLM's
forward pass (the tap in stagekit/vllm/tap.py): the same package, from the same layers.
The prompt is the ChatPrompt's (chat_prompt.py), as on transformers.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from omnipipe.api.adapters import Adapter
from omnipipe.families.qwen_omni.chat_prompt import ChatPrompt
from omnipipe.families.qwen_omni.handoff import LAYOUT_INPUTS, Handoff, pick_voice
from omnipipe.families.qwen_omni.qwen3 import Qwen3Handoff
from omnipipe.families.qwen_omni.qwen25 import Qwen25Handoff, read_speakers
from omnipipe.stagekit.chat_media import processor_warnings_silenced
from omnipipe.stagekit.media_limits import EffectiveMedia
from omnipipe.stagekit.replies import THINKER_SAMPLING, ReplyText, sampling_params
from omnipipe.stagekit.sampling import Sampling
from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    StageInputError,
    StageJob,
    StepResult,
    StreamingStage,
)
from omnipipe.stagekit.vllm.engine import VllmEngine
from omnipipe.stagekit.vllm.lora import VllmAdapters, lora_engine_args
from omnipipe.stagekit.vllm.refusals import engine_refusal


class VllmThinkerBase(StreamingStage):
    """A Qwen Omni thinker on vLLM; a version's stage names its Handoff and its speakers."""

    engine: VllmEngine
    sessions: dict[str, VllmThinkerSession]
    takes_adapters = True
    handoff_class: type[Handoff]

    def load(self) -> None:
        from transformers import AutoConfig, AutoProcessor, GenerationConfig

        self.config = AutoConfig.from_pretrained(self.model_path)
        self.sampling = Sampling.from_params(THINKER_SAMPLING, self.spec.sampling)
        processor = AutoProcessor.from_pretrained(self.model_path)
        self.tokenizer = processor.tokenizer
        speakers = self.speakers()
        eos: Any = None
        with contextlib.suppress(OSError):
            eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
        if eos is None:
            eos = self.config.thinker_config.text_config.eos_token_id
        self.eos = frozenset([eos] if isinstance(eos, int) else eos)
        args = lora_engine_args(self.spec.adapters, self.spec.engine_args)
        layers = self.handoff_class.hidden_layers(self.config)
        self.engine = VllmEngine(self.model_path, args, self.device, layers)
        self.adapters = VllmAdapters(self.engine.llm, enabled=bool(args.get("enable_lora")))
        self.adapters.update(self.spec.adapters)
        self.handoff = self.handoff_class(self.config, self.engine.embed, speakers)
        self.sessions = {}
        self.chat = ChatPrompt(
            processor, self.spec.media, self.context_length, self.engine.encoder_cache_tokens
        )

    def speakers(self) -> dict[str, Any]:
        """The checkpoint's speaker map; none by default."""
        return {}

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
        """The engine's max_model_len (engineArgs', else the model's own)."""
        return self.engine.max_model_len

    def reset_cache(self, which: str) -> None:
        self.engine.reset_cache(which)

    def set_adapters(self, adapters: Sequence[Adapter]) -> list[str]:
        return self.adapters.update(adapters)

    def prepare(self, job: StageJob) -> None:
        self.chat.prepare(job)

    def open(self, job: StageJob) -> Session:
        return VllmThinkerSession(self, job)

    def advance(self) -> list[Any]:
        """One engine step for every open request; outputs go to their sessions and are
        returned (for a request no session owns)."""
        if not self.engine.llm.has_unfinished_requests():
            raise RuntimeError("the vLLM engine has no request left to run")
        outputs = self.engine.llm.step()
        for output in outputs:
            session = self.sessions.get(output.request_id)
            if session is not None:
                session.receive(output)
        self.progress()
        return outputs


class VllmThinkerStage(VllmThinkerBase):
    """Qwen2.5-Omni's thinker on vLLM."""

    handoff_class = Qwen25Handoff

    def speakers(self) -> dict[str, Any]:
        return read_speakers(self.model_path)


class VllmQwen3ThinkerStage(VllmThinkerBase):
    """Qwen3-Omni's thinker on vLLM; the talker also takes one mid-layer state."""

    handoff_class = Qwen3Handoff


class VllmThinkerSession(Session):
    """One request in the shared engine. Text goes to the router as tokens arrive; with
    audio, the talker gets the prompt package with the first reply row, then one row per
    reply token fed to the model (so one token behind the text, as vLLM computes a
    token's state in the step that samples the next)."""

    def __init__(self, stage: VllmThinkerBase, job: StageJob) -> None:
        params = job.params
        self.stage = stage
        self.want_audio = bool(params.get("audio"))
        if self.want_audio:
            self.voice = pick_voice(params, stage.handoff.voices)
        self.sampling = Sampling.from_params(stage.sampling, params.get("sampling"))
        conversation, chat_media = stage.chat.prepared(job)
        text = stage.chat.prompt_text(conversation)
        self.media_inputs: dict[str, torch.Tensor] = {}
        if self.want_audio and chat_media:
            # The talker's rope index needs the image and video grids and audio lengths,
            # which vLLM keeps to itself: the processor works them out again for audio
            # requests.
            processed = stage.chat.model_inputs(text, chat_media)
            self.media_inputs = {
                k: processed[k] for k in LAYOUT_INPUTS if processed.get(k) is not None
            }
        rate = stage.chat.sampling_rate
        media: dict[str, Any] = {}
        self.media = media
        if chat_media.images:
            media["image"] = chat_media.images
        if chat_media.audios:
            media["audio"] = [(clip, rate) for clip in chat_media.audios]
        if chat_media.videos:
            media["video"] = chat_media.videos
        # The same processor arguments the transformers engine uses (fps, use_audio_in_video).
        self.mm_kwargs = chat_media.processor_kwargs()
        forced = params.get("forced_reply")
        self.forced: list[int] | None = None
        prompt: dict[str, Any]
        if forced is not None:
            if not isinstance(forced, str) or not forced:
                raise StageInputError("input must be a non-empty string")
            if media:
                raise StageInputError("a forced reply takes a text-only conversation")
            # The reply is known: prompt and reply run as one prefill, whose rows past the
            # prompt are the reply rows the talker needs.
            self.forced = stage.tokenizer(forced, add_special_tokens=False).input_ids
            ids = stage.tokenizer(text).input_ids
            self.prompt_length = len(ids)
            prompt = {"prompt_token_ids": ids + self.forced}
            max_tokens = 1
        else:
            prompt = {"prompt": text}
            if media:
                prompt["multi_modal_data"] = media
            if self.mm_kwargs:
                prompt["mm_processor_kwargs"] = self.mm_kwargs
            max_tokens = self.sampling.max_tokens
            self.prompt_length = 0  # known once vLLM has processed the prompt
        self.request_id = f"thinker-{uuid.uuid4().hex}"
        llm = stage.engine.llm
        params = sampling_params(self.sampling, stage.eos, max_tokens)
        lora = stage.adapters.request_for(job.params)
        from vllm.exceptions import VLLMClientError

        try:
            with processor_warnings_silenced():
                self.engine_id = llm.add_request(
                    self.request_id,
                    prompt,  # type: ignore[arg-type]
                    params,
                    lora_request=lora,
                )
        except (ValueError, TypeError, VLLMClientError) as exc:
            # Too long for the context, an image or clip the processor rejects: vLLM
            # refuses before the request takes any engine time.
            raise StageInputError(
                f"the thinker refused the input: {engine_refusal(exc)}", param="messages"
            ) from None
        stage.sessions[self.request_id] = self
        if self.want_audio:
            stage.engine.tap.want(self.engine_id)
        self.generated: list[int] = []
        self.prompt_ids: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.fresh = False  # something arrived since the last step
        self.reply = ReplyText(stage.tokenizer, stage.eos)
        self.rows_sent = 0
        self.prompt_rows: dict[int, torch.Tensor] | None = None
        self.closed = False

    def receive(self, output: Any) -> None:
        if not self.prompt_ids and output.prompt_token_ids:
            self.prompt_ids = list(output.prompt_token_ids)
            if self.forced is None:
                self.prompt_length = len(self.prompt_ids)
        completion = output.outputs[0]
        self.generated.extend(completion.token_ids)
        if output.finished:
            self.finished = True
            self.finish_reason = completion.finish_reason
        self.fresh = True

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        while not self.fresh:
            self.stage.advance()
        self.fresh = False
        with torch.inference_mode():
            tensors = self._handoff() if self.want_audio else {}
        if self.forced is not None:
            return self._finish_forced(tensors)
        outputs = self._delta(final=self.finished)
        if self.finished:
            outputs.append(self._usage(self.finish_reason or "stop", len(self.generated)))
        return StepResult(tensors=tensors, outputs=outputs, done=self.finished)

    def _usage(self, reason: str, completion_tokens: int) -> dict[str, Any]:
        return {
            "finish_reason": reason,
            "prompt_tokens": self.prompt_length,
            "completion_tokens": completion_tokens,
        }

    def _finish_forced(self, tensors: dict[str, torch.Tensor]) -> StepResult:
        assert self.forced is not None
        if not self.finished:
            return StepResult(tensors=tensors)
        text = self.stage.tokenizer.decode(self.forced, skip_special_tokens=True)
        # As the transformers engine counts it: the reply, then the end-of-turn token.
        usage = self._usage("stop", len(self.forced) + 1)
        return StepResult(tensors=tensors, outputs=[{"text": text}, usage], done=True)

    def _delta(self, final: bool) -> list[dict[str, Any]]:
        return self.reply.delta(self.generated, final)

    def _handoff(self) -> dict[str, torch.Tensor]:
        """The rows captured since the last step, as the talker takes them."""
        rows = self.stage.engine.tap.take(self.engine_id)
        tensors: dict[str, torch.Tensor] = {}
        if rows is not None:
            if self.prompt_rows is None:
                # The first rows are the prompt's (from one prefill or several chunks of
                # it), maybe followed by reply rows if this session missed an engine step.
                n = self.prompt_length
                self.prompt_rows = {k: v[:n] for k, v in rows.items()}
                rows = {k: v[n:] for k, v in rows.items()}
            reply = self._reply_rows(rows)
            if reply is not None:
                if self.rows_sent == 0:
                    tensors.update(self._prompt_package())
                tensors["reply"] = reply
                self.rows_sent += int(reply.shape[0])
        if self.finished and self.rows_sent == 0:
            # One-token answer: vLLM never ran that token through the model, but the
            # talker cannot start without its row. Compute it with one more prefill.
            tensors.update(self._prompt_package())
            tensors["reply"] = self._first_row_alone()
            self.rows_sent = 1
        return tensors

    def _reply_rows(self, rows: dict[int, torch.Tensor]) -> torch.Tensor | None:
        if not rows or next(iter(rows.values())).shape[0] == 0:
            return None
        count = next(iter(rows.values())).shape[0]
        return torch.cat(
            [
                self.stage.handoff.reply_row({k: v[None, : i + 1] for k, v in rows.items()})
                for i in range(count)
            ]
        )

    def _first_token(self) -> int:
        if self.forced is not None:
            return self.forced[0]
        return self.generated[0]

    def _prompt_package(self) -> dict[str, torch.Tensor]:
        assert self.prompt_rows is not None
        n = self.prompt_length
        ids = self.prompt_ids[:n]
        inputs = {"input_ids": torch.tensor([ids]), **self.media_inputs}
        hidden = {k: v[None, :n] for k, v in self.prompt_rows.items()}
        package = self.stage.handoff.talker_prompt(inputs, hidden, self.voice)
        return {**package, "first_token_id": torch.tensor([self._first_token()])}

    def _first_row_alone(self) -> torch.Tensor:
        from vllm import SamplingParams

        stage = self.stage
        llm = stage.engine.llm
        request_id = f"{self.request_id}-first"
        prompt: dict[str, Any] = {"prompt_token_ids": [*self.prompt_ids, self._first_token()]}
        if self.media:
            prompt["multi_modal_data"] = self.media
        if self.mm_kwargs:
            prompt["mm_processor_kwargs"] = self.mm_kwargs
        params = SamplingParams(max_tokens=1, detokenize=False)
        with processor_warnings_silenced():
            engine_id = llm.add_request(request_id, prompt, params)  # type: ignore[arg-type]
        stage.engine.tap.want(engine_id)
        try:
            # Other requests advance too; their outputs still reach their sessions.
            while not any(o.request_id == request_id and o.finished for o in stage.advance()):
                pass
            rows = stage.engine.tap.take(engine_id)
        finally:
            stage.engine.tap.forget(engine_id)
        assert rows is not None
        last = {k: v[-1:] for k, v in rows.items()}
        reply = self._reply_rows(last)
        assert reply is not None
        return reply

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        stage = self.stage
        stage.sessions.pop(self.request_id, None)
        stage.engine.tap.forget(self.engine_id)
        if not self.finished:
            # A cancel or timeout: free the request's slot and KV cache in the engine now.
            stage.engine.llm.abort_request([self.request_id])
