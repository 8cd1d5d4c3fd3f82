"""vLLM as the engine of autoregressive stages: one in-process LLMEngine per worker, which
batches every open request of the stage continuously (vLLM's scheduler), driven step by
step from the worker's engine thread.

In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor) because the talker's
hidden states are read off the model runner in this process (engines/vllm_tap.py); that
also limits a stage replica to one device (no tensor parallelism) for now.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from omnipipe.stagekit.vllm.tap import PINNED_VLLM, HiddenStateTap, embed_tokens, install

# What these stages need from vLLM, whatever engineArgs say: the model in this process,
# and every prompt token run through the model (a prefix-cache hit skips it, and with it
# the hidden states the talker needs).
REQUIRED_ARGS: dict[str, Any] = {
    "distributed_executor_backend": "uni",
    "enable_prefix_caching": False,
}
# CPU: vLLM's CPU attention has no bf16 path for every op, and no CUDA graphs.
CPU_DEFAULT_ARGS: dict[str, Any] = {"dtype": "float32", "enforce_eager": True}
# The KV cache vLLM's CPU backend reserves, GiB (its default takes a share of all memory).
CPU_KV_CACHE_GIB = "1"


class EngineConfigError(ValueError):
    """engineArgs that vLLM does not take, or that this stage cannot run with."""


def engine_arguments(
    engine_args: dict[str, Any], device: torch.device, fixed: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The stage's engineArgs checked against vLLM's EngineArgs, with our defaults; `fixed`
    are what the stage itself needs (a model override), not the user's to set."""
    from vllm import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise EngineConfigError(f"engineArgs not known to vLLM's EngineArgs: {', '.join(unknown)}")
    clashes = sorted(
        k for k, v in REQUIRED_ARGS.items() if k in engine_args and engine_args[k] != v
    )
    if clashes:
        raise EngineConfigError(
            f"engineArgs {', '.join(clashes)} must stay "
            + ", ".join(f"{k}={REQUIRED_ARGS[k]!r}" for k in clashes)
            + ": the talker's hidden states are read in this process, for every prompt token"
        )
    taken = sorted(set(fixed or {}) & set(engine_args))
    if taken:
        raise EngineConfigError(f"engineArgs {', '.join(taken)} are set by this stage itself")
    defaults = CPU_DEFAULT_ARGS if device.type == "cpu" else {}
    return {**defaults, **engine_args, **REQUIRED_ARGS, **(fixed or {})}


def check_version() -> None:
    import vllm

    if vllm.__version__ != PINNED_VLLM:
        raise RuntimeError(
            f"vLLM {vllm.__version__} is installed; omnipipe's hidden-state tap was written "
            f"against {PINNED_VLLM} (omnipipe/stagekit/vllm/tap.py). Install "
            f"{PINNED_VLLM}, or re-check the tap against the new version and raise the pin."
        )


class VllmEngine:
    """An LLMEngine plus, when `layers` are named, the tap on its forward pass."""

    def __init__(
        self,
        model_path: str,
        engine_args: dict[str, Any],
        device: torch.device,
        layers: list[int],
        fixed: dict[str, Any] | None = None,
    ) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # The taps and feeds read the V1 model runner (engines/vllm_tap.py), and its
        # pooling runner is the one that runs code2wav's "plugin" task; vLLM picks V2
        # wherever Triton runs (a GPU). Read once, when the process's first engine starts.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        check_version()
        from vllm import EngineArgs, LLMEngine

        args = EngineArgs(model=model_path, **engine_arguments(engine_args, device, fixed))
        self.llm = LLMEngine.from_engine_args(args)
        if self.llm.vllm_config.use_v2_model_runner:
            raise RuntimeError(
                "vLLM chose its V2 model runner; omnipipe's vLLM stages need V1 "
                "(VLLM_USE_V2_MODEL_RUNNER=0 must be set before the process's first engine)"
            )
        self.max_model_len = int(self.llm.model_config.max_model_len)
        # The most tokens vLLM's encoder cache holds for one media item: an item past it
        # is refused (vllm/v1/engine/input_processor.py); 0 where the model takes none.
        cache = getattr(getattr(self.llm, "input_processor", None), "mm_encoder_cache_size", 0)
        self.encoder_cache_tokens: int | None = int(cache) or None
        self.tap = HiddenStateTap(layers)
        if layers:
            self.llm.collective_rpc(install, args=(self.tap,))  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Stop the engine now. vLLM's shutdown also tears down its process-wide parallel
        state, which every engine in the process runs on: a process with several (tests,
        benchmarks) shuts them all down together, after their last step."""
        self.llm.engine_core.shutdown()

    def reset_cache(self, which: str) -> None:
        """vLLM's own resets: "prefix" frees the cached blocks no running request holds
        (vLLM refuses while requests run, so the stage is paused first); "mm" drops the
        processed-media cache."""
        if which == "prefix":
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache: requests hold blocks")
        elif which == "mm":
            self.llm.reset_mm_cache()  # type: ignore[no-untyped-call]
        else:
            raise NotImplementedError(f"vLLM keeps no {which} cache")

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The thinker's input embeddings of these token ids, on the CPU."""
        rows: torch.Tensor = self.llm.collective_rpc(
            embed_tokens,  # type: ignore[arg-type]
            args=(token_ids,),
        )[0]
        return rows
