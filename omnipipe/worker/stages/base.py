"""What a stage does with its inputs, independent of transport and HTTP."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnipipe.api import ResolvedStage

Tensors = dict[str, torch.Tensor]


class StageInputError(ValueError):
    """The request's parameters or inputs cannot be processed (a client error)."""


@dataclass
class StageJob:
    params: dict[str, Any]
    inputs: dict[str, Tensors]  # upstream stage name -> its tensors
    # Set when the request is cancelled; long engine loops check it between steps.
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class StageResult:
    tensors: Tensors = field(default_factory=dict)  # handed to the next stage
    outputs: list[dict[str, Any]] = field(default_factory=list)  # returned to the router


class Stage(ABC):
    """One stage. load() runs once; run_batch() runs in the worker's engine thread."""

    def __init__(self, spec: ResolvedStage, model_path: str, device: str) -> None:
        self.spec = spec
        self.model_path = model_path
        self.device = torch.device(device)

    @abstractmethod
    def load(self) -> None: ...

    @abstractmethod
    def run(self, job: StageJob) -> StageResult: ...

    def batch_key(self, job: StageJob) -> Hashable | None:
        """Jobs with equal, non-None keys may run in one run_batch call."""
        return None

    def run_batch(self, jobs: Sequence[StageJob]) -> list[StageResult]:
        return [self.run(job) for job in jobs]
