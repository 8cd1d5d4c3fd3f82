"""KV blocks through a worker's runtime: a stage gets the blocks its upstream sent as rows
of the receiver's BlockTable, and the rows go back to the table when the job ends, also
when it fails."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omnipipe.api.spec import Role
from omnipipe.api.wire import SubmitRequest
from omnipipe.stagekit.stage import Stage, StageInputError, StageJob, StageResult
from omnipipe.transfer import BlockTable, Mailbox, Message, make_receiver, make_sender
from omnipipe.worker.metrics import WorkerMetrics
from omnipipe.worker.runtime import StageRuntime
from tests.unit.test_omni_stages import spec

pytestmark = pytest.mark.timeout(30)
BLOCK_BYTES = 64


class SumsBlocks(Stage):
    def __init__(self) -> None:
        super().__init__(spec("generate", Role.DENOISER), "unused", "cpu")
        self.seen: list[list[float]] = []

    def load(self) -> None:
        pass

    def run(self, job: StageJob) -> StageResult:
        if job.params.get("fail"):
            raise StageInputError("refused")
        rows = job.blocks["think"]
        self.seen.append([float(r.view(torch.float32).sum()) for r in rows])
        return StageResult()


async def one_request(fail: bool) -> tuple[SumsBlocks, BlockTable, str]:
    table = BlockTable(8, BLOCK_BYTES)
    mailbox = Mailbox()
    receiver = make_receiver("tcp", mailbox, credential="t", block_table=table)
    await receiver.start()
    sender = make_sender("tcp", credential="t")
    stage = SumsBlocks()
    metrics = WorkerMetrics.create("p", "generate")
    runtime = StageRuntime("generate", stage, mailbox, make_sender("tcp"), metrics, 1)
    runtime.start()
    try:
        blocks = [torch.full((BLOCK_BYTES // 4,), float(i)) for i in (1, 2, 3)]
        await sender.send(receiver.address, Message("r1", "think", {}, blocks=blocks))
        assert table.free_blocks == 5
        job = runtime.submit(
            SubmitRequest(
                request_id="r1", params={"fail": fail}, inputs=["think"], timeout_seconds=10
            )
        )
        assert job.task is not None
        await asyncio.wait_for(job.task, 10)
        events = []
        while not job.events.empty():
            events.append(job.events.get_nowait())
        await asyncio.sleep(0.1)  # the rows go back after the engine thread's turn
        return stage, table, events[-1].type
    finally:
        await runtime.close()
        await sender.close()
        await receiver.close()


def test_a_stage_reads_its_blocks_and_the_rows_go_back() -> None:
    stage, table, last = asyncio.run(one_request(fail=False))
    assert last == "done"
    assert stage.seen == [[16.0, 32.0, 48.0]]  # 16 floats of 1, 2, 3
    assert table.free_blocks == 8


def test_the_rows_go_back_when_the_job_fails() -> None:
    stage, table, last = asyncio.run(one_request(fail=True))
    assert last == "error"
    assert stage.seen == []
    assert table.free_blocks == 8
