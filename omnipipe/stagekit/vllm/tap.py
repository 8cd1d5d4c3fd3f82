"""The one place omnipipe reaches into vLLM's private internals: a tap on the model
runner's forward pass that keeps, per request, the hidden states the talker needs.

vLLM has no output field for the hidden states of generated tokens. The model runner's
`_model_forward` is the hook vLLM itself documents for subclasses that inspect the
forward pass; this wraps it on the live runner instance and reads, per step, which rows
of the flattened batch belong to which request (`input_batch.req_ids`,
`query_start_loc`, `input_batch.num_computed_tokens_cpu`). These attributes were read
from PINNED_VLLM; tests/unit/test_vllm_thinker.py checks the states against
transformers' and fails the day they change.

Layer numbering follows transformers' `hidden_states` tuple: 0 is the input embeddings
(with image and audio features merged in), k in 1..L-1 the output of decoder layer k-1
(0-based), and -1 the final, normed output.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

PINNED_VLLM = "0.32.0"
FINAL = -1


@dataclass
class _Rows:
    """One request's captured rows, in token order, per layer."""

    length: int = 0  # rows captured so far (prompt and fed reply tokens)
    taken: int = 0  # rows already handed out
    layers: dict[int, list[torch.Tensor]] = field(default_factory=dict)


class HiddenStateTap:
    """Filled on the engine's forward pass, read by the stage after each engine step.
    Both run on the worker's engine thread; the lock guards against a reader elsewhere."""

    def __init__(self, layers: Iterable[int]) -> None:
        self.layers = tuple(sorted(set(layers)))
        self._wanted: dict[str, _Rows] = {}
        self._lock = threading.Lock()

    def want(self, request_id: str) -> None:
        """Keep this request's rows (requests not named here cost nothing)."""
        with self._lock:
            self._wanted[request_id] = _Rows(layers={k: [] for k in self.layers})

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._wanted.pop(request_id, None)

    def take(self, request_id: str) -> dict[int, torch.Tensor] | None:
        """The rows captured since the last take, per layer; None if there are none."""
        with self._lock:
            rows = self._wanted.get(request_id)
            if rows is None or rows.length == rows.taken:
                return None
            out = {}
            for k, parts in rows.layers.items():
                out[k] = torch.cat(parts) if len(parts) > 1 else parts[0]
                parts.clear()
            rows.taken = rows.length
            return out

    def record(
        self,
        request_ids: list[str],
        starts: list[int],
        bounds: list[int],
        states: dict[int, torch.Tensor],
    ) -> None:
        """Rows bounds[i]:bounds[i+1] of the flattened batch are request_ids[i]'s tokens
        from position starts[i] on. Rows seen before (a preempted request's recompute)
        are skipped: they are the same tokens again."""
        with self._lock:
            for i, request_id in enumerate(request_ids):
                rows = self._wanted.get(request_id)
                if rows is None:
                    continue
                begin, end = bounds[i], bounds[i + 1]
                start = starts[i]
                if start > rows.length:
                    raise RuntimeError(
                        f"hidden-state tap: request {request_id} skipped positions "
                        f"{rows.length}..{start - 1}"
                    )
                skip = rows.length - start
                if skip >= end - begin:
                    continue
                for k in self.layers:
                    # The runner reuses its buffers: copy out before the next step.
                    rows.layers[k].append(states[k][begin + skip : end].to("cpu", copy=True))
                rows.length = start + (end - begin)


def _decoder_layers(model: Any) -> Any:
    language_model = model.get_language_model() if hasattr(model, "get_language_model") else model
    inner = getattr(language_model, "model", language_model)
    return inner.layers


def install(worker: Any, tap: HiddenStateTap) -> None:
    """Runs inside vLLM's worker (LLMEngine.collective_rpc): wraps the runner's forward."""
    runner = worker.model_runner
    model = runner.get_model()
    layer_outputs: dict[int, torch.Tensor] = {}

    def keep_output(index: int) -> Any:
        def hook(_module: Any, _args: tuple[Any, ...], output: Any) -> None:
            # vLLM's decoder layers return (hidden, residual) with the residual add left
            # for the next norm; transformers' state is their sum, taken before anything
            # (Qwen3-Omni's deepstack features) is added between layers.
            hidden, residual = output
            layer_outputs[index] = hidden if residual is None else hidden + residual

        return hook

    layers = _decoder_layers(model)
    for k in tap.layers:
        if k not in (0, FINAL):
            layers[k - 1].register_forward_hook(keep_output(k))

    original = runner._model_forward

    def tapped_forward(*args: Any, **kwargs: Any) -> Any:
        output = original(*args, **kwargs)
        batch = runner.input_batch
        count = batch.num_reqs
        if count == 0 or not tap._wanted:
            return output
        embeds = kwargs.get("inputs_embeds")
        states = dict(layer_outputs)
        if 0 in tap.layers:
            if not isinstance(embeds, torch.Tensor):
                raise RuntimeError("hidden-state tap: the runner passed no inputs_embeds")
            states[0] = embeds
        states[FINAL] = output
        tap.record(
            list(batch.req_ids[:count]),
            [int(x) for x in batch.num_computed_tokens_cpu[:count]],
            [int(x) for x in runner.query_start_loc.np[: count + 1]],
            states,
        )
        layer_outputs.clear()
        return output

    runner._model_forward = tapped_forward


def embed_tokens(worker: Any, token_ids: torch.Tensor) -> torch.Tensor:
    """Runs inside vLLM's worker: the model's input embeddings of token_ids, on the CPU."""
    model = worker.model_runner.get_model()
    weight = next(model.parameters())
    flat = token_ids.reshape(-1).to(weight.device)
    with torch.inference_mode():
        rows: torch.Tensor = model.embed_input_ids(flat)
    return rows.reshape(*token_ids.shape, -1).to("cpu", copy=True)
