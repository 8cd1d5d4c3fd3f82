"""`omnipipe worker` with a fake engine: each stage sleeps `engine_args.seconds` per
request and hands `engine_args.nbytes` of tensor to the next stage. It stands in for
balanced compute, to measure pipelining itself (scheduling, hand-offs, overlap) on a
machine with fewer cores than stages. Everything else is the real worker.

    .venv/bin/python bench/_sleep_worker.py worker --pipeline FILE --stage NAME ...
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omnipipe.api import ResolvedStage
from omnipipe.cli import main
from omnipipe.stagekit.stage import Stage, StageJob, StageResult
from omnipipe.worker import server


class SleepStage(Stage):
    def load(self) -> None:
        self.seconds = float(self.spec.engine_args.get("seconds", 0.05))
        self.payload = torch.ones(
            int(self.spec.engine_args.get("nbytes", 65536)), dtype=torch.uint8
        )

    def run(self, job: StageJob) -> StageResult:
        time.sleep(self.seconds)
        return StageResult(tensors={"x": self.payload}, outputs=[{"b64_json": ""}])


def _sleep_stage(spec: ResolvedStage, model_path: str, pipeline: str | None = None) -> type[Stage]:
    return SleepStage


server.stage_class = _sleep_stage

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
