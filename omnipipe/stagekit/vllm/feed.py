"""Per-position input rows for a vLLM model whose every step takes more than a token id:
the Qwen Omni talker adds the thinker's row for that position to its codec embedding.

vLLM 0.32 has no public way to hand a running request a new input row at each decode
step, so this wraps the model runner's `_model_forward`, as engines/vllm_tap.py does, and
reads the same private attributes (`input_batch.req_ids`, `num_computed_tokens_cpu`,
`query_start_loc`) to know which request and position each row of the flattened batch
is. It then gives the model the rows for exactly those positions, and the 3-D M-RoPE
positions the stage computed. Rows are kept by position, so a recompute after preemption
gets the same inputs. tests/unit/test_vllm_talker.py fails the day those attributes change.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class FedRequest:
    """One request's inputs by position.

    rows[p] is position p's row; past them, `after` once, then `tail` forever (the text
    eos row, then text pad), or, while the thinker still runs (None), nothing: the
    request must not get that far. Positions from `codec_from` on add the embedding of
    their token id. The prompt's positions are `positions` (3 x prompt length); decode
    position p is p + delta on all three axes."""

    rows: torch.Tensor
    after: torch.Tensor | None
    tail: torch.Tensor | None
    codec_from: int
    positions: torch.Tensor
    delta: int


@dataclass(frozen=True)
class Span:
    """Rows begin:end of the flattened batch are request_id's positions from start on."""

    request_id: str
    begin: int
    end: int
    start: int


@dataclass(frozen=True)
class StepFeed:
    """What the model reads in one forward: a row, an add-the-codec flag and a 3-D
    position for every row of the flattened batch, and which request each span is."""

    rows: torch.Tensor
    add_codec: torch.Tensor
    positions: torch.Tensor
    spans: tuple[Span, ...] = ()


class RowFeed:
    """Filled by the stage (engine thread), read inside vLLM's forward (same thread); the
    lock guards a reader elsewhere."""

    def __init__(self) -> None:
        # Each request's rows as one table (its rows, then `after` and `tail` once the
        # thinker is done), built once: a step only indexes it.
        self._requests: dict[str, tuple[FedRequest, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def put(self, request_id: str, request: FedRequest) -> None:
        table = request.rows
        if request.after is not None and request.tail is not None:
            table = torch.cat([request.rows, request.after[None], request.tail[None]])
        with self._lock:
            self._requests[request_id] = (request, table)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def attach(self, model: Any) -> None:
        """Given the engine's model once, when the hook is installed."""

    def step(
        self, request_ids: list[str], starts: list[int], bounds: list[int], total: int
    ) -> StepFeed:
        """The inputs of a forward whose rows bounds[i]:bounds[i+1] are request_ids[i]'s
        positions from starts[i] on; rows past bounds[-1] (padding) get zeros."""
        with self._lock:
            found = [self._requests.get(r) for r in request_ids]
        missing = [r for r, f in zip(request_ids, found, strict=True) if f is None]
        if missing:
            raise RuntimeError(f"row feed: no rows for request(s) {', '.join(missing)}")
        fed = [f for f in found if f is not None]
        width = fed[0][1].shape[1]
        rows = torch.zeros(total, width, dtype=fed[0][1].dtype)
        add_codec = torch.zeros(total, dtype=torch.bool)
        positions = torch.zeros(3, total, dtype=torch.long)
        for i, (request, table) in enumerate(fed):
            begin, end = bounds[i], bounds[i + 1]
            wanted = torch.arange(starts[i], starts[i] + end - begin)
            rows[begin:end] = _rows_at(request, table, wanted)
            add_codec[begin:end] = wanted >= request.codec_from
            prompt = request.positions.shape[1]
            positions[:, begin:end] = torch.where(
                wanted < prompt,
                request.positions[:, wanted.clamp(max=prompt - 1)],
                wanted + request.delta,
            )
        spans = tuple(
            Span(r, bounds[i], bounds[i + 1], starts[i]) for i, r in enumerate(request_ids)
        )
        return StepFeed(rows, add_codec, positions, spans)

    def after_forward(self, step: StepFeed, hidden: torch.Tensor) -> None:
        """Called with the forward's output; a model that needs its own last states (a
        code predictor's input) keeps them here."""


def _rows_at(request: FedRequest, table: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    known = request.rows.shape[0]
    if request.after is None or request.tail is None:
        if int(wanted.max()) >= known:
            raise RuntimeError(f"row feed: position {int(wanted.max())} has no row yet")
        return table[wanted]
    return table[wanted.clamp(max=known + 1)]


def install(worker: Any, feed: RowFeed) -> None:
    """Runs inside vLLM's worker (LLMEngine.collective_rpc): wraps the runner's forward so
    the model's `feed` holds this step's inputs while it runs. The profile and warm-up
    runs, with no request scheduled, leave it None."""
    runner = worker.model_runner
    model = runner.get_model()
    feed.attach(model)
    original = runner._model_forward

    def fed_forward(*args: Any, **kwargs: Any) -> Any:
        batch = runner.input_batch
        count = batch.num_reqs
        input_ids = kwargs.get("input_ids")
        if count == 0:
            return original(*args, **kwargs)
        if not isinstance(input_ids, torch.Tensor):
            # The model would run on zero rows: refuse rather than decode garbage.
            raise RuntimeError("row feed: the runner passed no input_ids by name")
        step = feed.step(
            list(batch.req_ids[:count]),
            [int(x) for x in batch.num_computed_tokens_cpu[:count]],
            [int(x) for x in runner.query_start_loc.np[: count + 1]],
            input_ids.shape[0],
        )
        device = input_ids.device
        model.feed = dataclasses.replace(
            step,
            rows=step.rows.to(device),
            add_codec=step.add_codec.to(device),
            positions=step.positions.to(device),
        )
        try:
            output = original(*args, **kwargs)
            feed.after_forward(model.feed, output)
            return output
        finally:
            model.feed = None

    runner._model_forward = fed_forward
