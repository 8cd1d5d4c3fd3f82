"""CFG-parallel: a request's negative branch runs on a second device beside the positive.

Under classifier-free guidance every step needs two noise predictions. On one device the
denoiser runs them as one batch of two; with cfgParallelSize 2 it keeps a second copy of
the DiT on a second device, runs the negative rows there while the positive rows run on
the first, and brings the negative prediction back to combine. Each device's forward
issues its own kernels from its own thread, as torch.nn.parallel.parallel_apply does, so a
step takes the longer of the two forwards instead of their sum."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def branch_device(device: torch.device) -> torch.device:
    """The second device: the next GPU after the stage's own, or the CPU again."""
    if device.type != "cuda":
        return device
    index = device.index or 0
    if torch.cuda.device_count() < index + 2:
        raise ValueError(
            f"acceleration.cfgParallelSize 2 needs a second GPU after {device}; this "
            f"process sees {torch.cuda.device_count()} (set the stage's resources.gpus to 2)"
        )
    return torch.device("cuda", index + 1)


class BranchDevice:
    """The DiT's copy on the second device, and the thread that drives it."""

    def __init__(self, load: Callable[[torch.device], torch.nn.Module], device: torch.device):
        self.device = branch_device(device)
        # Loaded straight onto its device: a copy of the first would pass through it, and
        # a real-size DiT does not fit twice on one GPU.
        self.transformer = load(self.device)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="cfg-branch")

    def _on_device(self) -> AbstractContextManager[Any]:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    def beside(self, branch: Callable[[torch.nn.Module], T], main: Callable[[], T]) -> tuple[T, T]:
        """Runs branch on this device while main runs on the caller's; both results."""

        def run() -> T:
            # inference_mode is per thread: the caller's does not reach this one.
            with self._on_device(), torch.inference_mode():
                return branch(self.transformer)

        pending = self._thread.submit(run)
        try:
            mine = main()
        except BaseException:
            wait([pending])  # the branch's device is free again before the error goes on
            raise
        return mine, pending.result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
