"""Qwen2.5-Omni's talker on vLLM: every open request of the stage in one continuous batch
with paged KV, where the transformers talker steps one request at a time.

Each request is added to the engine once the thinker has finished its reply, with all of
its rows (prompt, reply, then text-eos and text-pad for ever) in the row feed
(engines/vllm_feed.py) and the 3-D rope positions transformers' talker would use. One
engine step then advances every running request by one code. The codes, the stop codes,
the suppressed codec-bos and the penalty set are those of qwen25.TalkerSession, which
stays the reference (tests/unit/test_vllm_talker.py holds the two equal).

Starting at the thinker's end, not its first token, costs time to first audio on long
replies; vLLM 0.32 cannot make a running request wait for its next row.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from omnipipe.families.qwen_omni.qwen25 import CHUNK_CODES, TALKER_SAMPLING, samples_per_code
from omnipipe.families.qwen_omni.thinker import layout_kwargs
from omnipipe.worker.engines.vllm import VllmEngine
from omnipipe.worker.engines.vllm_feed import FedRequest, RowFeed, install
from omnipipe.worker.stages.base import (
    Chunk,
    Session,
    StageInputError,
    StageJob,
    StepOutcome,
    StepResult,
)
from omnipipe.worker.stages.codec import SAMPLE_RATE, CodecTalkerStage, TalkerSessionBase
from omnipipe.worker.stages.replies import sampling_params
from omnipipe.worker.stages.sampling import Sampling

MODEL_CLASS = "omnipipe.families.qwen_omni.vllm_talker_model:Qwen25OmniTalkerForVllm"


class TalkerConfigOverride:
    """vLLM's `hf_overrides`: the checkpoint's talker config as the model config. vLLM
    first calls it on a bare config to see whether the model type changes; that one goes
    through unchanged."""

    def __call__(self, config: Any) -> Any:
        from omnipipe.families.qwen_omni.vllm_talker_model import ARCHITECTURE

        talker = getattr(config, "talker_config", None)
        if talker is None:
            return config
        talker.architectures = [ARCHITECTURE]
        return talker


class RopeIndex:
    """transformers' talker rope index (it reads only the config), without the model."""

    def __init__(self, config: Any) -> None:
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as m

        owner = m.Qwen2_5OmniPreTrainedModelForConditionalGeneration
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self._index = owner.get_rope_index
        self.get_llm_pos_ids_for_vision = owner.get_llm_pos_ids_for_vision.__get__(self)
        self.get_chunked_index = owner.get_chunked_index.__get__(self)

    def __call__(self, text_ids: torch.Tensor, layout: dict[str, Any]) -> tuple[torch.Tensor, int]:
        positions, deltas = self._index(
            self,  # type: ignore[arg-type]  # reads only config and spatial_merge_size
            text_ids[None],  # type: ignore[arg-type]
            layout["image_grid_thw"],
            layout["video_grid_thw"],
            torch.ones_like(text_ids[None]),
            layout["use_audio_in_video"],
            layout["audio_feature_lengths"],
            layout["video_second_per_grid"],
        )
        return positions[:, 0], int(deltas.reshape(-1)[0])


class VllmTalkerStage(CodecTalkerStage):
    sessions: dict[str, VllmTalkerSession]

    def load(self) -> None:
        from transformers import AutoConfig
        from vllm import ModelRegistry

        from omnipipe.families.qwen_omni.vllm_talker_model import ARCHITECTURE

        config = AutoConfig.from_pretrained(self.model_path)
        self.config = config.talker_config
        self.sampling = Sampling.from_params(TALKER_SAMPLING, self.spec.sampling)
        self.codes_per_second = SAMPLE_RATE / samples_per_code(config)
        self.chunk_codes = int(self.spec.engine_args.get("chunk_codes", CHUNK_CODES))
        c = self.config
        self.stop_codes = frozenset({c.tts_codec_pad_token_id, c.tts_codec_end_token_id})
        # Every code but codec-bos, as transformers' talker suppresses it.
        self.allowed = [i for i in range(c.vocab_size) if i != c.tts_codec_start_token_id]
        self.rope_index = RopeIndex(c)
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
        engine_args = {k: v for k, v in self.spec.engine_args.items() if k != "chunk_codes"}
        with tempfile.TemporaryDirectory() as generation:
            # The checkpoint's generation config is the thinker's (its eos would stop the
            # talker); vLLM reads this one at start-up instead.
            (Path(generation) / "generation_config.json").write_text(
                json.dumps({"eos_token_id": sorted(self.stop_codes)})
            )
            fixed = {
                "hf_overrides": TalkerConfigOverride(),
                "skip_tokenizer_init": True,
                "generation_config": generation,
            }
            self.engine = VllmEngine(self.model_path, engine_args, self.device, [], fixed)
        self.feed = RowFeed()
        self.engine.llm.collective_rpc(install, args=(self.feed,))  # type: ignore[arg-type]
        self.sessions = {}

    def open(self, job: StageJob) -> Session:
        return VllmTalkerSession(self, job.params)

    def step_sessions(self, work: Sequence[tuple[Session, Sequence[Chunk]]]) -> list[StepOutcome]:
        """Starts the sessions whose thinker has finished, then runs one engine step,
        which advances every running request (those not in `work` keep their codes until
        they step)."""
        started: list[StepOutcome | Exception] = []
        for session, chunks in work:
            assert isinstance(session, VllmTalkerSession)
            try:
                session.start(chunks)
                started.append(None)
            except Exception as exc:
                started.append(exc)
        llm = self.engine.llm
        running = any(isinstance(s, VllmTalkerSession) and s.running for s, _ in work)
        if running and llm.has_unfinished_requests():
            try:
                for output in llm.step():
                    owner = self.sessions.get(output.request_id)
                    if owner is not None:
                        owner.receive(output)
            except Exception as exc:
                return [exc] * len(work)
            self.progress()
        outcomes: list[StepOutcome] = []
        for (session, _), error in zip(work, started, strict=True):
            assert isinstance(session, VllmTalkerSession)
            outcomes.append(error if isinstance(error, Exception) else session.result())
        return outcomes


class VllmTalkerSession(TalkerSessionBase):
    def __init__(self, stage: VllmTalkerStage, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        self.stage = stage
        self.request_id = f"talker-{uuid.uuid4().hex}"
        self.engine_id: str | None = None
        self.codes: list[int] = []
        self.finished = False

    @property
    def made(self) -> list[int]:
        return self.codes

    @property
    def running(self) -> bool:
        return self.engine_id is not None and not self.finished

    def start(self, chunks: Sequence[Chunk]) -> None:
        """Takes the chunks; once the thinker is done, adds the request to the engine."""
        self._take(chunks)
        if self.engine_id is not None or not self.upstream_done:
            return
        if self.prompt is None or not self.replies:
            raise StageInputError("the thinker ended without a reply for the talker")
        stage, p = self.stage, self.prompt
        c = stage.config
        length = int(p["input_ids"].shape[0])
        text_ids = torch.cat([p["input_ids"], p["text_bos_id"], p["first_token_id"]])
        positions, delta = stage.rope_index(text_ids, layout_kwargs(p))
        rows = torch.cat([p["prompt_embeds"], p["text_bos_embed"][None], *self.replies])
        self.replies.clear()
        prompt_ids = [c.tts_codec_mask_token_id] * length + [
            c.tts_codec_pad_token_id,
            c.tts_codec_start_token_id,
        ]
        room = stage.engine.max_model_len - len(prompt_ids)
        if room < 1:
            raise StageInputError(
                f"the talker's prompt is {len(prompt_ids)} positions; its engine takes "
                f"{stage.engine.max_model_len}"
            )
        params = sampling_params(
            self.sampling, stage.stop_codes, min(self.sampling.max_tokens, room), stage.allowed
        )
        from vllm.inputs import TokensPrompt

        try:
            engine_id = stage.engine.llm.add_request(
                self.request_id,
                TokensPrompt(prompt_token_ids=prompt_ids),
                params,
            )
        except ValueError as exc:
            raise StageInputError(f"the talker's engine refused the request: {exc}") from None
        stage.feed.put(
            engine_id,
            FedRequest(
                rows=rows.float(),
                after=p["text_eos_embed"].float(),
                tail=p["text_pad_embed"].float(),
                codec_from=length,
                positions=positions,
                delta=delta,
            ),
        )
        self.engine_id = engine_id
        stage.sessions[self.request_id] = self

    def receive(self, output: Any) -> None:
        codes = list(output.outputs[0].token_ids)
        self.codes += [c for c in codes if c not in self.stage.stop_codes]
        self.finished = bool(output.finished)

    def result(self) -> StepResult | None:
        """What the last engine step made for this request; None while the thinker runs."""
        if self.engine_id is None:
            return None
        return self._emit(self.finished)

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        outcome = self.stage.step_sessions([(self, chunks)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def close(self) -> None:
        stage = self.stage
        stage.sessions.pop(self.request_id, None)
        if self.engine_id is not None:
            stage.feed.forget(self.engine_id)
            if not self.finished:
                stage.engine.llm.abort_request([self.request_id])
        self.engine_id = None
