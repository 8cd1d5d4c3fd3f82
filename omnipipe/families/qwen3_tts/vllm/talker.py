"""Qwen3-TTS's talker on vLLM: every open request of the stage in one continuous batch
with paged KV (talker_model.py), where the transformers talker takes one forward per
request a frame. The request is read, its voice checked and its prompt built as the
transformers talker does (talker.TalkerSession, the reference: tests/unit/
test_qwen3_tts_vllm.py holds the greedy frames equal); vLLM samples the first codes, the
code predictor makes each frame inside the forward that feeds its first code back.

Every row is known when the request opens (the prompt's, then the text's one a step,
then tts_pad), so a request is one engine request from its prompt to its end.
"""

from __future__ import annotations

import json
import logging
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omnipipe.families.qwen3_tts.config import PREFIX_CODES, qwen3_config
from omnipipe.families.qwen3_tts.prompt import prompt_embeds
from omnipipe.families.qwen3_tts.talker import TalkerSession, TalkerStage
from omnipipe.families.qwen3_tts.vllm.frames import TalkerFrameFeed
from omnipipe.families.qwen3_tts.vllm.talker_model import CHECKPOINT_KEY
from omnipipe.stagekit.code2wav import SAMPLE_RATE
from omnipipe.stagekit.replies import sampling_params
from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    StageInputError,
    StageJob,
    StepOutcome,
    StepResult,
)
from omnipipe.stagekit.vllm.engine import VllmEngine
from omnipipe.stagekit.vllm.feed import FedRequest, install
from omnipipe.stagekit.vllm.frames import FrameState

log = logging.getLogger(__name__)
ARCHITECTURE = "OmnipipeQwen3TTSTalker"
MODEL_CLASS = "omnipipe.families.qwen3_tts.vllm.talker_model:TalkerForVllm"


class VllmTalkerStage(TalkerStage):
    def load(self) -> None:
        from vllm import ModelRegistry

        super().load()
        # The stage keeps the text tables and the codec embedding for the prompt's rows;
        # vLLM runs the decoder and the code predictor.
        self.model.model.layers = nn.ModuleList()
        self.stop_codes = frozenset({self.config.eos})
        # The codes vLLM may pick: all but those the transformers talker suppresses.
        suppressed = set(self.suppressed)
        self.allowed = [i for i in range(self.config.vocab) if i not in suppressed]
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
        engine_args = {k: v for k, v in self.spec.engine_args.items() if k != "chunk_codes"}
        with tempfile.TemporaryDirectory() as folder:
            decoder = qwen3_config(self.config.talker)
            decoder.vocab_size = self.config.vocab
            decoder.architectures = [ARCHITECTURE]
            setattr(decoder, CHECKPOINT_KEY, str(Path(self.model_path).resolve()))
            decoder.save_pretrained(folder)
            # The checkpoint's generation config is qwen-tts's sampling; vLLM reads this
            # one for its stop codes.
            (Path(folder) / "generation_config.json").write_text(
                json.dumps({"eos_token_id": [self.config.eos]})
            )
            fixed = {
                "hf_config_path": folder,
                "skip_tokenizer_init": True,
                "generation_config": folder,
            }
            self.engine = VllmEngine(self.model_path, engine_args, self.device, [], fixed)
        self.feed = TalkerFrameFeed()
        self.engine.llm.collective_rpc(install, args=(self.feed,))  # type: ignore[arg-type]
        self.sessions: dict[str, VllmTalkerSession] = {}

    def open(self, job: StageJob) -> Session:
        return VllmTalkerSession(self, job.params, job.prepared)

    def step_sessions(self, work: Sequence[tuple[Session, Sequence[Chunk]]]) -> list[StepOutcome]:
        """Adds an engine request for each new session, then runs one engine step, which
        advances every running request (those not in `work` keep their frames until they
        step)."""
        started: list[Exception | None] = []
        for session, _ in work:
            assert isinstance(session, VllmTalkerSession)
            try:
                session.start()
                started.append(None)
            except Exception as exc:
                started.append(exc)
        llm = self.engine.llm
        if llm.has_unfinished_requests():
            try:
                outputs = llm.step()
            except Exception as exc:
                log.error("the talker's engine step failed; failing its requests: %s", exc)
                for session in list(self.sessions.values()):
                    session.fail(exc)
                outputs = []
            for output in outputs:
                owner = self.sessions.get(output.request_id)
                if owner is not None:
                    owner.receive(output)
            self.progress()
        outcomes: list[StepOutcome] = []
        for (session, _), error in zip(work, started, strict=True):
            assert isinstance(session, VllmTalkerSession)
            try:
                outcomes.append(error if error is not None else session.result())
            except Exception as exc:
                outcomes.append(exc)
        return outcomes


class VllmTalkerSession(TalkerSession):
    stage: VllmTalkerStage

    def __init__(self, stage: VllmTalkerStage, params: dict[str, Any], prepared: Any) -> None:
        super().__init__(stage, params, prepared)
        self.request_id: str | None = None
        self.engine_id: str | None = None
        self.frame_state: FrameState | None = None
        self.finished = False
        self.error: Exception | None = None
        self.told_prompt = False

    def start(self) -> None:
        """The engine request, once: the prompt's rows, then the text's, then tts_pad."""
        if self.request_id is not None or self.finished or self.error is not None:
            return
        from vllm.inputs import TokensPrompt

        stage = self.stage
        with torch.inference_mode():
            prompt = prompt_embeds(
                stage.model,
                stage.config,
                self.text_ids,
                self.instruction_ids,
                self.voice,
                streaming_text=stage.config.kind == "base",
                reference_ids=self.reference_ids,
            )
        length = prompt.rows.shape[1]
        room = stage.engine.max_model_len - length
        if room < 1:
            raise StageInputError(
                f"input: the talker's prompt is {length} positions; its engine takes "
                f"{stage.engine.max_model_len} (engineArgs.max_model_len)",
                "input",
            )
        pad = prompt.tts_pad[0, 0].float().cpu()
        fed = FedRequest(
            rows=torch.cat((prompt.rows[0], prompt.trailing[0])).float().cpu(),
            after=pad,
            tail=pad,
            codec_from=length,
            positions=torch.arange(length).expand(3, -1).clone(),
            delta=0,
        )
        self.frame_state = FrameState(length, self.predictor, self.generator)
        # The speech ends at max_new_tokens or where the engine's context does.
        limit = min(self.sampling.max_tokens, room)
        params = sampling_params(self.sampling, stage.stop_codes, limit, stage.allowed)
        request_id = f"talker-{uuid.uuid4().hex}"
        try:
            engine_id = stage.engine.llm.add_request(
                request_id,
                TokensPrompt(prompt_token_ids=[stage.config.code("pad")] * length),
                params,
            )
        except ValueError as exc:
            raise StageInputError(f"the talker's engine refused the request: {exc}") from None
        stage.feed.put(engine_id, fed)
        stage.feed.track(engine_id, self.frame_state)
        self.request_id, self.engine_id = request_id, engine_id
        stage.sessions[request_id] = self

    def receive(self, output: Any) -> None:
        self.codes += [c for c in output.outputs[0].token_ids if c not in self.stage.stop_codes]
        if not output.finished:
            return
        self._leave()
        reason = output.outputs[0].finish_reason
        if reason not in ("stop", "length"):
            self.error = RuntimeError(f"the talker's engine ended the speech: {reason}")
            return
        self.finished = True

    def _collect(self) -> None:
        """Adds to self.frames each first code fed back since, with the predictor's codes
        (the frames so far stay: one lookup a frame, not all of them every step)."""
        state = self.frame_state
        if state is None:
            return
        while len(self.frames) < len(self.codes):
            rest = state.codes.get(state.frames_from + len(self.frames))
            if rest is None:
                break
            self.frames.append([self.codes[len(self.frames)], *rest])

    def result(self) -> StepResult | None:
        if self.error is not None:
            raise self.error
        self._collect()
        due = self.first_chunk if self.sent == 0 else self.stage.chunk_codes
        if len(self.frames) - self.sent < due and not self.finished:
            result = StepResult()
        else:
            chunk = self.frames[self.sent :]
            tensors = {"codes": torch.tensor(chunk, dtype=torch.long)} if chunk else {}
            if self.sent == 0 and self.voice.reference_codes is not None:
                tensors[PREFIX_CODES] = self.voice.reference_codes
            self.sent = len(self.frames)
            result = StepResult(
                tensors=tensors,
                done=self.finished,
                audio_seconds=len(chunk) * self.stage.config.samples_per_frame / SAMPLE_RATE,
            )
        if not self.told_prompt:  # the speech's usage counts the input's tokens (SSE)
            self.told_prompt = True
            result.outputs.append({"prompt_tokens": int(self.text_ids.shape[1])})
        return result

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        outcome = self.stage.step_sessions([(self, chunks)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def fail(self, error: Exception) -> None:
        self.close()
        self.error = error

    def _leave(self) -> None:
        stage = self.stage
        if self.request_id is not None:
            stage.sessions.pop(self.request_id, None)
        if self.engine_id is not None:
            stage.feed.forget(self.engine_id)
        self.request_id = self.engine_id = None

    def close(self) -> None:
        request_id, running = self.request_id, self.engine_id is not None
        self._leave()
        if running and request_id is not None:
            self.stage.engine.llm.abort_request([request_id])
