"""LoRA adapters in a vLLM engine (vLLM's own multi-LoRA: requests with different adapters
share a batch), for the autoregressive stages: the engine arguments that enable it, and
the adapters loaded into a running engine, changed all or nothing."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omnipipe.api.adapters import MAX_ADAPTERS, MAX_LORA_RANK, Adapter
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.stagekit.stage import StageInputError

log = logging.getLogger(__name__)

# vLLM's LoRAConfig.max_lora_rank takes only these.
VLLM_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
# Room for adapters added while the engine runs, unless engineArgs.max_loras says otherwise.
HEADROOM = 4
# vLLM 0.32's CPU LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py) index the stacked adapter
# weights with each token's slot, and a token without an adapter has slot -1: Python's
# last slot. While that slot holds no adapter its weights are zeros and the base model is
# untouched; once it holds one, every request without an adapter gets it. vLLM fills the
# first free slot, so keeping fewer adapters loaded than it has slots keeps the last one
# empty (tests/e2e/test_control_api.py: a batch that mixes adapters and none).
SPARE_SLOTS_ON_CPU = 1


def _rank(path: str) -> int:
    config = Path(path) / "adapter_config.json"
    try:
        rank = int(json.loads(config.read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: no PEFT adapter_config.json with a rank r ({exc})") from None
    if not 1 <= rank <= MAX_LORA_RANK:
        raise ValueError(f"{path}: LoRA rank {rank}; a stage loads ranks 1 to {MAX_LORA_RANK}")
    return rank


def lora_engine_args(adapters: Sequence[Adapter], engine_args: Mapping[str, Any]) -> dict[str, Any]:
    """engineArgs with vLLM's LoRA enabled, sized for these adapters (engineArgs' own
    max_lora_rank and max_loras win): a stage started with none keeps LoRA off, as vLLM
    does by default, since its layers then run without the LoRA kernels."""
    args = dict(engine_args)
    if not adapters:
        return args
    rank = max(_rank(resolve_model_path(a.source)) for a in adapters)
    args.setdefault("enable_lora", True)
    args.setdefault("max_lora_rank", next((r for r in VLLM_RANKS if r >= rank), rank))
    args.setdefault("max_loras", len(adapters) + HEADROOM)
    # Every adapter stays in vLLM's CPU cache: none is evicted while it is in the spec.
    args.setdefault("max_cpu_loras", max(MAX_ADAPTERS, int(args["max_loras"])))
    return args


class VllmAdapters:
    """The adapters loaded into one vLLM engine, by name."""

    def __init__(self, llm: Any, enabled: bool) -> None:
        self._llm = llm
        self._enabled = enabled
        config = llm.vllm_config.lora_config if enabled else None
        cpu = llm.vllm_config.device_config.device.type == "cpu"
        # At most this many loaded at once (see SPARE_SLOTS_ON_CPU).
        self.capacity = (
            0 if config is None else config.max_loras - (SPARE_SLOTS_ON_CPU if cpu else 0)
        )
        self._loaded: dict[str, tuple[str, Any]] = {}  # name -> (source, LoRARequest)
        self._next_id = 1

    @property
    def names(self) -> set[str]:
        return set(self._loaded)

    def update(self, adapters: Sequence[Adapter]) -> list[str]:
        """Loads what is new (or has a new source), then drops what is gone; the names
        after. A load that fails drops what this call loaded and raises: all or nothing."""
        if adapters and not self._enabled:
            raise NotImplementedError(
                "its vLLM engine started without LoRA (the stage had no adapters): it "
                "loads adapters once restarted with some"
            )
        from vllm.lora.request import LoRARequest

        if len(adapters) > self.capacity:
            raise ValueError(
                f"{len(adapters)} adapters, but this engine holds {self.capacity} (its "
                "engineArgs.max_loras, less a spare slot on the CPU): raise max_loras, which "
                "restarts the stage"
            )
        wanted = {a.name: a.source for a in adapters}
        # New ones first, under new ids, so that a failure leaves the set as it was.
        added: dict[str, tuple[str, Any]] = {}
        try:
            for name, source in wanted.items():
                if name in self._loaded and self._loaded[name][0] == source:
                    continue
                request = LoRARequest(name, self._next_id, resolve_model_path(source))
                self._next_id += 1
                if not self._llm.add_lora(request):
                    raise RuntimeError(f"vLLM did not load adapter {name} from {source}")
                added[name] = (source, request)
        except Exception:
            for _, request in added.values():
                self._llm.remove_lora(request.lora_int_id)
            raise
        for name, (source, request) in list(self._loaded.items()):
            if wanted.get(name) != source:
                self._llm.remove_lora(request.lora_int_id)
                del self._loaded[name]
        self._loaded.update(added)
        return sorted(self._loaded)

    def request_for(self, params: Mapping[str, Any]) -> Any:
        """The LoRARequest of the request's `lora` parameter (set by the router), or None
        for the base model. vLLM applies an adapter whole: a scale must be 1."""
        lora = params.get("lora")
        if lora is None:
            return None
        if not isinstance(lora, Mapping):
            raise StageInputError("lora: must be an object with a name")
        name, scale = lora.get("name"), lora.get("scale", 1.0)
        if name not in self._loaded:
            raise StageInputError(f"lora.name: this stage has no adapter {name!r}")
        if scale != 1.0:
            raise StageInputError(
                f"lora.scale: an adapter of an autoregressive stage applies whole (scale 1), "
                f"got {scale!r}"
            )
        return self._loaded[str(name)][1]
