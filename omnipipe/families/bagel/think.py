"""BAGEL's think stage on vLLM: understanding (text answers, optionally before an image)
and, for an image, the KV cache of the context and its CFG companions, taken out of the
engine by the KV connector (engines/vllm_kv.py) and handed to the generate stage.

A request that wants text runs its answer first and streams it; the image's context is
then the conversation with the answer. Each context is one prefill in the shared engine
(a request with the connector's export prefix and one output token); the generate stage
never prefills. The caches go as KV blocks (bagel/kv_blocks.py), received straight into
the generate worker's block table. Contexts with no tokens (the no-text companion of a
text-only prompt) are not sent: the generate stage uses the empty cache for them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import torch

from omnipipe.families.bagel.config import understanding_image_tokens
from omnipipe.families.bagel.context import (
    FULL,
    Prompt,
    Turn,
    answer_prompt,
    image_contexts,
    token_id,
)
from omnipipe.families.bagel.kv_blocks import LAYOUT, kv_dtype, pack
from omnipipe.families.bagel.mot import ContextKV
from omnipipe.families.bagel.params import cfg_scale
from omnipipe.stagekit.media import charge_media, decode_image
from omnipipe.stagekit.media_limits import EffectiveMedia, ModelMedia, effective_media
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
from omnipipe.stagekit.vllm.kv import EXPORT_PREFIX, kv_transfer_config, take_exported
from omnipipe.stagekit.vllm.refusals import engine_refusal

MAX_IMAGES = 4
MEDIA_KINDS = ("image",)  # an audio part gets its own refusal below


def conversation(
    params: dict[str, Any], media: EffectiveMedia | None = None
) -> tuple[list[Turn], list[Any]]:
    """Router messages (or an image request's prompt) -> turns and decoded images."""
    messages = params.get("messages")
    if messages is None:
        prompt = params.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise StageInputError("prompt must be a non-empty string")
        return [Turn("user", (prompt,))], []
    if not isinstance(messages, list) or not messages:
        raise StageInputError("messages must be a non-empty list")
    charge_media(messages, (media or EffectiveMedia()).budget(), kinds=MEDIA_KINDS)
    turns: list[Turn] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(role, str) or not isinstance(content, (str, list)):
            raise StageInputError(f"messages[{i}]: needs a role and a content")
        if isinstance(content, str):
            turns.append(Turn(role, (content,)))
            continue
        parts: list[str | int] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append(str(part.get("text", "")))
            elif kind == "image":
                if len(images) == MAX_IMAGES:
                    raise StageInputError(f"at most {MAX_IMAGES} images per request")
                images.append(decode_image(part.get("data"), f"messages[{i}].content[{j}]"))
                parts.append(len(images) - 1)
            else:
                raise StageInputError(f"messages[{i}].content[{j}]: BAGEL takes text and images")
        turns.append(Turn(role, tuple(parts)))
    return turns, images


class BagelThinkStage(StreamingStage):
    engine: VllmEngine

    def load(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eos = frozenset([token_id(self.tokenizer, "<|im_end|>")])
        self.sampling = Sampling.from_params(THINKER_SAMPLING, self.spec.sampling)
        args = {**dict(self.spec.engine_args), "kv_transfer_config": kv_transfer_config()}
        self.engine = VllmEngine(self.model_path, args, self.device, [])
        self.sessions: dict[str, BagelThinkSession] = {}
        model = ModelMedia(self.engine.max_model_len, understanding_image_tokens(self.model_path))
        self.media_limits = effective_media(self.spec.media, model, MEDIA_KINDS)

    def prepare(self, job: StageJob) -> None:
        job.prepared = conversation(job.params, self.media_limits)

    def text_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_cache(self, which: str) -> None:
        self.engine.reset_cache(which)

    def open(self, job: StageJob) -> Session:
        if job.prepared is None:
            self.prepare(job)
        return BagelThinkSession(self, job.params, job.prepared)

    def advance(self) -> None:
        """One engine step for every open request; outputs go to their sessions."""
        if not self.engine.llm.has_unfinished_requests():
            raise RuntimeError("the vLLM engine has no request left to run")
        for output in self.engine.llm.step():
            session = self.sessions.get(output.request_id)
            if session is not None:
                session.receive(output)
        self.progress()

    def add(
        self, session: BagelThinkSession, prompt: Prompt, params: Any, export: bool
    ) -> tuple[str, str]:
        """Adds a request; returns its id (outputs carry it) and the engine's id for it
        (the scheduler's, which the connector sees)."""
        request_id = f"{EXPORT_PREFIX if export else ''}{uuid.uuid4().hex}"
        inputs: dict[str, Any] = {"prompt": prompt.text}
        if prompt.images:
            inputs["multi_modal_data"] = {"image": list(prompt.images)}
        from vllm.exceptions import VLLMClientError

        try:
            engine_id = self.engine.llm.add_request(request_id, inputs, params)  # type: ignore[arg-type]
        except (ValueError, TypeError, VLLMClientError) as exc:
            raise StageInputError(
                f"the think stage refused the input: {engine_refusal(exc)}", param="messages"
            ) from None
        self.sessions[request_id] = session
        return request_id, str(engine_id)

    def take_cache(self, engine_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        exported = self.engine.llm.collective_rpc(take_exported, args=(engine_id,))[0]  # type: ignore[arg-type]
        if exported is None:
            raise RuntimeError(f"the KV connector exported no cache for {engine_id}")
        keys, values = exported
        return keys, values


class BagelThinkSession(Session):
    def __init__(
        self,
        stage: BagelThinkStage,
        params: dict[str, Any],
        prepared: tuple[list[Turn], list[Any]],
    ) -> None:
        self.stage = stage
        self.want_text = bool(params.get("text", False))
        self.want_image = bool(params.get("image", True))
        if not (self.want_text or self.want_image):
            raise StageInputError("nothing to make: ask for text, an image or both")
        self.text_cfg = cfg_scale(params, "cfg_text_scale", 4.0) > 1.0
        self.image_cfg = cfg_scale(params, "cfg_img_scale", 1.0) > 1.0
        self.turns, self.images = prepared
        self.sampling = Sampling.from_params(stage.sampling, params.get("sampling"))
        self.pending: dict[str, tuple[str, str]] = {}  # request id -> (context, engine id)
        self.finished: set[str] = set()
        self.answer_id: str | None = None
        self.generated: list[int] = []
        self.prompt_tokens = 0
        self.answer_done = False
        self.fresh = False
        self.reply = ReplyText(stage.tokenizer, stage.eos)
        if self.want_text:
            params_ = sampling_params(self.sampling, stage.eos, self.sampling.max_tokens)
            prompt = answer_prompt(self.turns, self.images)
            self.answer_id, _ = stage.add(self, prompt, params_, export=False)
        else:
            self._start_contexts()

    def _start_contexts(self) -> None:
        from vllm import SamplingParams

        # One output token: the engine's prefill is the work; the token is thrown away.
        one = SamplingParams(max_tokens=1, detokenize=False)
        for name, prompt in image_contexts(
            self.turns, self.images, self.text_cfg, self.image_cfg
        ).items():
            if name == FULL and prompt.empty:
                raise StageInputError("the image's context is empty")
            if not prompt.empty:
                request_id, engine_id = self.stage.add(self, prompt, one, export=True)
                self.pending[request_id] = (name, engine_id)

    def receive(self, output: Any) -> None:
        if output.request_id == self.answer_id:
            if not self.prompt_tokens and output.prompt_token_ids:
                self.prompt_tokens = len(output.prompt_token_ids)
            self.generated.extend(output.outputs[0].token_ids)
            self.answer_done = bool(output.finished)
            self.finish_reason = output.outputs[0].finish_reason
        elif output.finished:
            self.finished.add(output.request_id)
        self.fresh = True

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        while not self.fresh:
            self.stage.advance()
        self.fresh = False
        if self.answer_id is not None:
            return self._answer_step()
        if len(self.finished) < len(self.pending):
            return StepResult()
        caches = {}
        for name, engine_id in self.pending.values():
            caches[name] = ContextKV(*self.stage.take_cache(engine_id))
        blocks, layout = pack(caches, kv_dtype(self.stage.device))
        for request_id in self.pending:
            self.stage.sessions.pop(request_id, None)
        self.pending = {}
        return StepResult(tensors={LAYOUT: layout}, blocks=blocks, done=True)

    def _answer_step(self) -> StepResult:
        outputs = self.reply.delta(self.generated, final=self.answer_done)
        if not self.answer_done:
            return StepResult(outputs=outputs)
        outputs.append(
            {
                "finish_reason": self.finish_reason or "stop",
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": len(self.generated),
            }
        )
        self.stage.sessions.pop(self.answer_id or "", None)
        self.finished.add(self.answer_id or "")
        self.answer_id = None
        if not self.want_image:
            return StepResult(outputs=outputs, done=True)
        # The image is made over the conversation with the answer in it.
        self.turns = [*self.turns, Turn("assistant", (self.reply.text,))]
        self._start_contexts()
        return StepResult(outputs=outputs)

    def close(self) -> None:
        llm = self.stage.engine.llm
        ids = [*self.pending, *([self.answer_id] if self.answer_id else [])]
        unfinished = [i for i in ids if i not in self.finished]
        for request_id in ids:
            self.stage.sessions.pop(request_id, None)
        if unfinished:
            # A cancel or timeout: free the requests' slots and KV cache in the engine.
            llm.abort_request(unfinished)
        for _, engine_id in self.pending.values():
            # Whatever the connector exported for an abandoned context.
            llm.collective_rpc(take_exported, args=(engine_id,))  # type: ignore[arg-type]
        self.pending = {}
