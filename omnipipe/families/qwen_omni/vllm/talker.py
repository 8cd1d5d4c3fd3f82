"""What the Qwen Omni talkers on vLLM share (qwen25_talker.py, qwen3_talker.py):
every open answer of the stage in one continuous batch with paged KV, where the
transformers talkers step one answer at a time.

A request's rows (prompt, reply, and once the thinker is done the two rows after it) are
in the row feed (stagekit/vllm/feed.py) with the 3-D rope positions transformers' talker
would use. One engine step advances every running request by one code. vLLM 0.32 cannot
make a running request wait for its next row, so an answer runs as engine requests that
each make as many codes as there are rows: the first once chunk_codes rows are in (or
the thinker is done), the next, with the codes so far as its prompt and prefix caching
for the KV, once chunk_codes more are in. The codes, the stop codes, the suppressed
codes and the penalty set are those of the transformers talkers, which stay the
reference (tests/unit/test_vllm_talker.py holds them equal).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import uuid
from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from omnipipe.families.qwen_omni.codec import CodecTalkerStage, TalkerSessionBase
from omnipipe.stagekit.replies import sampling_params
from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    StageInputError,
    StepOutcome,
    StepResult,
)
from omnipipe.stagekit.vllm.engine import VllmEngine
from omnipipe.stagekit.vllm.feed import FedRequest, RowFeed, install

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TalkerConfigOverride:
    """vLLM's `hf_overrides`: the checkpoint's talker config as the model config, under
    our model's architecture name. vLLM first calls it on a bare config to see whether
    the model type changes; that one goes through unchanged."""

    architecture: str

    def __call__(self, config: Any) -> Any:
        talker = getattr(config, "talker_config", None)
        if talker is None:
            return config
        talker.architectures = [self.architecture]
        return talker


class VllmTalkerBase(CodecTalkerStage):
    """What the Qwen Omni talkers on vLLM share: the engine, its row feed, and stepping
    every open answer with one engine step. A family sets, in configure(), the codes
    that stop an answer, the codes it may pick, its sampling and chunk sizes."""

    sessions: dict[str, VllmTalkerSession]
    feed: RowFeed
    stop_codes: frozenset[int]
    allowed: list[int]
    architecture: str
    model_class: str

    @abstractmethod
    def configure(self, config: Any) -> None:
        """Everything load() needs from the checkpoint's config, before the engine."""

    def make_feed(self) -> RowFeed:
        return RowFeed()

    def load(self) -> None:
        from transformers import AutoConfig
        from vllm import ModelRegistry

        self.configure(AutoConfig.from_pretrained(self.model_path))
        ModelRegistry.register_model(self.architecture, self.model_class)
        engine_args = {k: v for k, v in self.spec.engine_args.items() if k != "chunk_codes"}
        with tempfile.TemporaryDirectory() as generation:
            # The checkpoint's generation config is the thinker's (its eos would stop the
            # talker); vLLM reads this one at start-up instead.
            (Path(generation) / "generation_config.json").write_text(
                json.dumps({"eos_token_id": sorted(self.stop_codes)})
            )
            fixed = {
                "hf_overrides": TalkerConfigOverride(self.architecture),
                "skip_tokenizer_init": True,
                "generation_config": generation,
                # A resumed answer recomputes only past its last full cached block.
                "enable_prefix_caching": True,
            }
            self.engine = VllmEngine(self.model_path, engine_args, self.device, [], fixed)
        self.feed = self.make_feed()
        self.engine.llm.collective_rpc(install, args=(self.feed,))  # type: ignore[arg-type]
        self.sessions = {}

    def step_sessions(self, work: Sequence[tuple[Session, Sequence[Chunk]]]) -> list[StepOutcome]:
        """Takes each session's chunks (adding an engine request where enough rows are
        in), then runs one engine step, which advances every running request (those not
        in `work` keep their codes until they step)."""
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
                outputs = llm.step()
            except Exception as exc:
                self._fail_running(exc)
                outputs = []
            for output in outputs:
                owner = self.sessions.get(output.request_id)
                if owner is not None:
                    owner.receive(output)  # keeps its own error
            self.progress()
        outcomes: list[StepOutcome] = []
        for (session, _), error in zip(work, started, strict=True):
            assert isinstance(session, VllmTalkerSession)
            try:
                outcomes.append(error if isinstance(error, Exception) else session.result())
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def _fail_running(self, error: Exception) -> None:
        """A failed engine step has advanced its requests' counters without their KV or
        outputs: none of them can go on. Each is aborted, and its answer (in this call's
        work or not) fails with the error."""
        log.error("the talker's engine step failed; failing its running answers: %s", error)
        for session in list(self.sessions.values()):
            session.fail(error)


class VllmTalkerSession(TalkerSessionBase):
    """One answer, run as one or more engine requests: each may make only as many codes
    as the thinker has sent rows for, and the next resumes (the codes so far as its
    prompt, recomputed from the last cached block) once chunk_codes more rows are in.

    The family's part: the codec prompt, its rows and rope positions (_prepare), how a
    reply row becomes a talker row (_row), and the rows after the reply (_tail)."""

    def __init__(self, stage: VllmTalkerBase, params: dict[str, Any]) -> None:
        super().__init__(stage, params)
        self.stage = stage
        self.session_id = uuid.uuid4().hex
        self.rows: list[torch.Tensor] = []  # every row so far, by position
        self.codec_prompt: list[int] = []
        self.codec_from = 0  # the first prompt position its codec embedding is added to
        self.positions: torch.Tensor | None = None
        self.delta = 0
        self.request_id: str | None = None  # the engine request now running
        self.engine_id: str | None = None
        self.requests = 0
        self.codes: list[int] = []
        self.finished = False
        self.rows_ran_out = False  # the running request stops where the rows do
        self.error: Exception | None = None

    @property
    def made(self) -> list[int]:
        return self.codes

    @property
    def running(self) -> bool:
        return self.engine_id is not None

    @property
    def codes_possible(self) -> int:
        """Codes the rows in allow: one from the prompt, one more per row past it."""
        return sum(len(r) for r in self.rows) - len(self.codec_prompt) + 1

    @abstractmethod
    def _prepare(self) -> None:
        """Sets codec_prompt, codec_from, rows, positions and delta from the thinker's
        package, taking the reply rows the prompt needs."""

    @abstractmethod
    def _row(self, reply: torch.Tensor) -> torch.Tensor:
        """A reply row as the talker's input row."""

    @abstractmethod
    def _tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows after the reply (one-dimensional): one once, the other for ever."""

    def _before_submit(self) -> None:
        """What a family must do before an engine request is added (may raise)."""

    def _track(self, engine_id: str) -> None:
        """A family with per-request engine state registers it with the feed (must not
        raise: the engine holds the request by then)."""

    def start(self, chunks: Sequence[Chunk]) -> None:
        """Takes the chunks, and adds an engine request when none runs and enough rows
        are in: chunk_codes more than the codes made, or the thinker is done."""
        self._take(chunks)
        if self.prompt is not None and self.replies and not self.codec_prompt:
            self._prepare()
        if self.codec_prompt:
            self.rows.extend(self._row(r) for r in self.replies)
            self.replies.clear()
        if not self.codec_prompt:
            if self.upstream_done:
                raise StageInputError("the thinker ended without a reply for the talker")
            return
        self._resume()

    def _resume(self) -> None:
        if self.running or self.finished or self.error is not None:
            return
        ahead = self.codes_possible - len(self.codes)
        left = self.sampling.max_tokens - len(self.codes)
        if self.upstream_done or (ahead > 0 and ahead >= min(self.stage.chunk_codes, left)):
            self._submit(None if self.upstream_done else ahead)

    def _submit(self, rows_ahead: int | None) -> None:
        from vllm.inputs import TokensPrompt

        stage = self.stage
        assert self.positions is not None
        prompt_ids = self.codec_prompt + self.codes
        room = stage.engine.max_model_len - len(prompt_ids)
        if room < 1:
            raise StageInputError(
                f"the talker's prompt is {len(prompt_ids)} positions; its engine takes "
                f"{stage.engine.max_model_len}"
            )
        left = self.sampling.max_tokens - len(self.codes)
        limit = min(left, room) if rows_ahead is None else min(left, room, rows_ahead)
        self.rows_ran_out = rows_ahead is not None and rows_ahead < min(left, room)
        seed = self.sampling.seed
        sampling = dataclasses.replace(
            self.sampling,
            min_tokens=max(0, self.sampling.min_tokens - len(self.codes)),
            # vLLM seeds each request afresh: a resumed one must not replay the noise.
            seed=None if seed is None else seed + len(self.codes),
        )
        params = sampling_params(sampling, stage.stop_codes, limit, stage.allowed)
        # Everything that can fail comes before the engine takes the request.
        after, tail = self._tail() if self.upstream_done else (None, None)
        fed = FedRequest(
            rows=torch.cat(self.rows).float(),
            after=None if after is None else after.float(),
            tail=None if tail is None else tail.float(),
            codec_from=self.codec_from,
            positions=self.positions,
            delta=self.delta,
        )
        self._before_submit()
        self.requests += 1
        request_id = f"talker-{self.session_id}-{self.requests}"
        try:
            engine_id = stage.engine.llm.add_request(
                request_id,
                # The salt keeps one answer's cached blocks to itself: its rows are its own.
                TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=self.session_id),
                params,
            )
        except ValueError as exc:
            raise StageInputError(f"the talker's engine refused the request: {exc}") from None
        stage.feed.put(engine_id, fed)
        self._track(engine_id)
        self.request_id, self.engine_id = request_id, engine_id
        stage.sessions[request_id] = self

    def receive(self, output: Any) -> None:
        codes = list(output.outputs[0].token_ids)
        self.codes += [c for c in codes if c not in self.stage.stop_codes]
        if not output.finished:
            return
        self._leave()
        reason = output.outputs[0].finish_reason
        if reason not in ("stop", "length"):
            self.error = RuntimeError(f"the talker's engine ended the answer: {reason}")
            return
        # Past max_tokens or the context's room, the answer ends; short of rows, it goes
        # on when they come (at once if they already have).
        self.finished = reason == "stop" or not self.rows_ran_out
        try:
            self._resume()
        except Exception as exc:
            self.error = exc

    def fail(self, error: Exception) -> None:
        """End the answer with `error`, aborting its engine request if one runs."""
        self.close()
        self.error = error

    def _leave(self) -> None:
        """Forget the engine request just finished (or aborted)."""
        stage = self.stage
        if self.request_id is not None:
            stage.sessions.pop(self.request_id, None)
        if self.engine_id is not None:
            stage.feed.forget(self.engine_id)
        self.request_id = self.engine_id = None

    def result(self) -> StepResult | None:
        """The codes to send after the last engine step; None while the session waits
        for the thinker's rows."""
        if self.error is not None:
            raise self.error
        if self.finished:
            return self._emit(True)
        emitted = self._emit(False)
        return emitted if emitted.tensors or self.running else None

    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        outcome = self.stage.step_sessions([(self, chunks)])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def close(self) -> None:
        request_id, running = self.request_id, self.running
        self._leave()
        if running and request_id is not None:
            self.stage.engine.llm.abort_request([request_id])
