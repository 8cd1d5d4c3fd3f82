"""What a stage does with its inputs, independent of transport and HTTP."""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnipipe.api import ResolvedStage
from omnipipe.api.adapters import Adapter
from omnipipe.api.param_limits import ParamLimit, exceeded
from omnipipe.api.plain_text import plain_message
from omnipipe.api.wire import StageEvent
from omnipipe.transfer import BlockTable

Tensors = dict[str, torch.Tensor]


# Request fields a client sends (OpenAI's and omnipipe's extensions): a message that
# starts with one names it, and the router's 400 carries it as `param`.
_PUBLIC_FIELD = re.compile(
    r"(?:messages|input|prompt|negative_prompt|image|voice|ref_audio|mm_processor_kwargs|size|n|seed"
    r"|num_inference_steps|guidance_scale|cfg_\w+|timestep_shift)(?:\[\d+\]|\.\w+)*"
    r"(?=[:\s]|$)"
)


class StageInputError(ValueError):
    """The request's parameters or inputs cannot be processed (a client error). `param`
    names the request field at fault, as the router's own 400s do; by default, the
    field the message starts with ("messages[0].content[1]: ...")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        if param is None and (field := _PUBLIC_FIELD.match(message)) is not None:
            param = field.group()
        self.message, self.param = message, param

    def event(self) -> StageEvent:
        """The request's error event: the router answers it as its own 400."""
        return StageEvent(
            type="error", code="invalid_request", message=self.message, param=self.param or ""
        )


def check_param_limits(params: Mapping[str, Any], limits: Sequence[ParamLimit]) -> None:
    """The request's 400 when a parameter goes past a limit the stage published: the
    words the router used, had it known the limit when the request came."""
    if (limit := exceeded(params, limits)) is not None:
        raise StageInputError(limit.refusal(params[limit.param]), limit.field)


MAX_REFUSAL_CHARS = 500


def refusal_message(exc: BaseException) -> str:
    """What a processor's or an engine's refusal says, fit for the client: the innermost
    cause's own message (vLLM wraps a processor's error in one that quotes the whole
    input, "Failed to apply ... on data={...}", and appends "(parameter=..., value=...)"
    to its own), with no object or array reprs, and short."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    return plain_message(message, MAX_REFUSAL_CHARS)


@dataclass
class StageJob:
    params: dict[str, Any]
    inputs: dict[str, Tensors]  # upstream stage name -> its tensors
    # Set when the request is cancelled; long engine loops check it between steps.
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Upstream stage name -> the KV blocks it sent, as rows of this worker's BlockTable
    # (bytes); the runtime frees the rows once the job is done.
    blocks: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # What StreamingStage.prepare made of the request (its decoded media), for open().
    prepared: Any = None
    # A one-shot stage that loops over steps itself (a whole diffusers pipeline) calls
    # this, on the engine thread, after each: (steps done, steps in all). The worker sends
    # the request a progress event where it asked for them.
    on_step: Callable[[int, int], None] = field(default=lambda step, steps: None)


@dataclass
class StageResult:
    tensors: Tensors = field(default_factory=dict)  # handed to the next stage
    outputs: list[dict[str, Any]] = field(default_factory=list)  # returned to the router
    # What this stage read and made of the request, counted (USAGE_KEYS): the router adds
    # up every stage's into the response's `usage`.
    usage: dict[str, int] = field(default_factory=dict)


def _no_watchdog() -> None:
    pass


def _no_count(kind: str, n: int) -> None:
    pass


class Stage(ABC):
    """One stage. load() runs once; run_batch() runs in the worker's engine thread."""

    # Which of spec.acceleration's settings the stage honours, by their names there.
    accelerations: frozenset[str] = frozenset()

    # Whether the stage loads spec.adapters (LoRA) and applies the one a request names.
    takes_adapters = False

    def __init__(self, spec: ResolvedStage, model_path: str, device: str) -> None:
        if spec.adapters and not self.takes_adapters:
            raise NotImplementedError(
                f"stage {spec.name}: {type(self).__name__} takes no LoRA adapters; remove "
                f"spec.adapters {', '.join(a.name for a in spec.adapters)}"
            )
        if spec.acceleration is not None:
            wanted = {
                "cache": spec.acceleration.cache is not None,
                "cfgParallelSize": spec.acceleration.cfg_parallel_size > 1,
                "quantization": spec.acceleration.quantization is not None,
            }
            if missing := [k for k, on in wanted.items() if on and k not in self.accelerations]:
                raise NotImplementedError(
                    f"stage {spec.name}: {type(self).__name__} does not support "
                    f"acceleration.{', acceleration.'.join(missing)}; remove it"
                )
        self.spec = spec
        self.model_path = model_path
        self.device = torch.device(device)
        # Long engine calls (a denoising loop) call this between units of work, so the
        # worker's watchdog can tell a slow engine from one that makes no progress.
        self.progress: Callable[[], None] = _no_watchdog
        # A stepped denoiser counts its request-steps, computed or reused ("computed",
        # "reused"), for the worker's metrics.
        self.count_steps: Callable[[str, int], None] = _no_count

    @abstractmethod
    def load(self) -> None: ...

    @abstractmethod
    def run(self, job: StageJob) -> StageResult: ...

    def set_adapters(self, adapters: Sequence[Adapter]) -> list[str]:
        """Loads the LoRA adapters of `adapters` the stage lacks and drops those it has
        that are not there (run on the engine thread, between batches); the names now
        loaded. A stage that takes none refuses."""
        raise NotImplementedError(f"{type(self).__name__} takes no LoRA adapters")

    def param_limits(self) -> Sequence[ParamLimit]:
        """The bounds the loaded model puts on request parameters (api/param_limits.py),
        which the router checks before it takes a request; read once, after load()."""
        return ()

    def preset_voices(self) -> Sequence[str]:
        """The voices the loaded model speaks by name (a TTS model's preset speakers, an
        omni model's), which GET /v1/audio/voices lists; none for most stages."""
        return ()

    def voice_prompt(self, clip: str, reference_text: str | None) -> dict[str, Any]:
        """A cloning model's prompt for a voice uploaded to the router: what its clip
        (base64 WAV) gives, made once on the engine thread and kept by the router (JSON),
        which sends it with each request that names the voice. A client's fault in the
        clip is a StageInputError; a stage that clones no voice refuses."""
        raise NotImplementedError(f"{type(self).__name__} clones no voice")

    def text_tokenizer(self) -> Any | None:
        """The tokenizer of the stage's text model (a transformers tokenizer, saved whole
        by get_tokenizer); None: the stage reads no text."""
        return None

    def reset_cache(self, which: str) -> None:
        """Clears the engine's "prefix" (KV blocks kept for reuse) or "mm" (processed
        media) cache, on the engine thread between batches. A stage without one refuses."""
        raise NotImplementedError(f"{type(self).__name__} keeps no {which} cache")

    def torch_modules(self) -> list[torch.nn.Module]:
        """The stage's torch models (attributes, and a diffusers pipeline's components):
        what sleep level 1 moves to host memory."""
        found: dict[int, torch.nn.Module] = {}
        for value in vars(self).values():
            parts = getattr(value, "components", None)
            if isinstance(parts, dict):
                inside = list(parts.values())
            elif not isinstance(value, torch.nn.Module) and hasattr(value, "__dict__"):
                inside = list(vars(value).values())  # a helper's own model (CFG's copy)
            else:
                inside = []
            for part in [value, *inside]:
                if isinstance(part, torch.nn.Module):
                    found.setdefault(id(part), part)
        return list(found.values())

    def kv_block_table(self) -> BlockTable | None:
        """The table KV blocks sent to this stage are received into (after load());
        None: this stage takes no KV blocks."""
        return None

    def batch_key(self, job: StageJob) -> Hashable | None:
        """Jobs with equal, non-None keys may run in one run_batch call."""
        return None

    def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
        return [self.run(job) for job in jobs]


class SteppedStage(Stage):
    """A stage whose engine work is a loop of steps that requests share: the runtime lets
    compatible requests (equal batch_key) join the running batch between steps, and one
    whose client has gone leaves at the next step while the rest go on."""

    @property
    def joins_between_steps(self) -> bool:
        """False: a batch runs from its first step to its last with none joining (a step
        cache compares each forward with the one before)."""
        return True

    @abstractmethod
    def begin(self, job: StageJob) -> Any:
        """The request's state before its first step (noise, schedule position)."""

    @abstractmethod
    def step(self, states: Sequence[Any]) -> None:
        """One step of every state, as one batch; advances each in place."""

    @abstractmethod
    def finished(self, state: Any) -> bool: ...

    def step_count(self, state: Any) -> tuple[int, int] | None:
        """How many of its steps the state has had, and of how many; None: untold."""
        return None

    @abstractmethod
    def finish(self, state: Any) -> StageResult: ...

    def run(self, job: StageJob) -> StageResult:
        return self.run_batch([job])[0]

    def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
        """All of `jobs` from their first step to their last, together (no joining)."""
        states = [self.begin(job) for job in jobs]
        while not all(self.finished(s) for s in states):
            if all(job.cancelled.is_set() for job in jobs):
                break
            self.step([s for s in states if not self.finished(s)])
        return [self.finish(s) for s in states]


@dataclass
class Chunk:
    """Part of one upstream stage's output, in the order it was sent."""

    source: str
    tensors: Tensors
    final: bool


@dataclass
class StepResult:
    tensors: Tensors = field(default_factory=dict)  # sent downstream as the next chunk
    # KV blocks sent with the chunk (Message.blocks): contiguous, all the same size.
    blocks: list[torch.Tensor] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)  # streamed to the router
    done: bool = False
    audio_seconds: float = 0.0  # audio this step produced, for TTFA and real-time factor


# What one session's step came to: its result, None (it waits for input), or its error.
StepOutcome = StepResult | Exception | None


class Session(ABC):
    """One request inside a streaming stage. Only the engine thread touches it."""

    @abstractmethod
    def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
        """Advance by one unit of work, given the chunks that arrived since the last call.
        None means nothing can be done until more input arrives."""

    @abstractmethod
    def close(self) -> None:
        """Free what the request holds (KV cache); called once, also on cancel."""


class StreamingStage(Stage):
    """A stage that starts on its inputs' first chunks and emits chunks as it goes. The
    worker interleaves the steps of all open sessions on its engine thread, so one slow
    or starved request does not hold the others."""

    def prepare(self, job: StageJob) -> None:
        """Work a request needs before its session opens that does not touch the engine
        (decoding its media), kept in job.prepared. The runtime runs it off the engine
        thread, so the open sessions' steps go on meanwhile, and beside other requests'
        preparation, so a long decode holds none of them: it must be safe to run on
        several threads at once (no tokenizer; a processor's tokenizer is not)."""

    @abstractmethod
    def open(self, job: StageJob) -> Session: ...

    def step_sessions(self, work: Sequence[tuple[Session, Sequence[Chunk]]]) -> list[StepOutcome]:
        """Each session stepped on its chunks: what its step returned, or what it raised
        (one request's failure is its own). The runtime hands over every session waiting
        to step; a stage that can run several sessions' steps as one forward overrides
        this."""
        results: list[StepOutcome] = []
        for session, chunks in work:
            try:
                results.append(session.step(chunks))
            except Exception as exc:
                results.append(exc)
            self.progress()
        return results

    def run(self, job: StageJob) -> StageResult:
        raise TypeError(f"{type(self).__name__} streams: use open()")
