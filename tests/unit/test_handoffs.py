"""Hand-offs per engine step, not per token (issue #25): a streaming step's chunks leave
in one batch per destination (HandOffs, Sender.send_batch), each message with its own
verdict, over both backends on loopback; an older receiver gets them one by one."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import pytest
import torch

from omnipipe.api.spec import Role
from omnipipe.api.wire import Destination, SubmitRequest
from omnipipe.stagekit.stage import (
    Chunk,
    Session,
    StageJob,
    StepOutcome,
    StepResult,
    StreamingStage,
)
from omnipipe.transfer import (
    CREDENTIAL_ENV,
    Mailbox,
    Message,
    Sender,
    TransferRefused,
    TransferStats,
    make_receiver,
    make_sender,
)
from omnipipe.transfer.base import SEND_ALONE, Outcome, Verdict
from omnipipe.transfer.codec import CodecError, decode_header
from omnipipe.transfer.handoffs import HandOffs
from omnipipe.worker.metrics import WorkerMetrics
from omnipipe.worker.runtime import StageRuntime
from tests.unit.test_omni_stages import spec

os.environ.setdefault("UCX_NET_DEVICES", "lo")
pytestmark = pytest.mark.timeout(60)
BACKENDS = ["tcp", "ucx"]
GUARD = 20  # seconds: only a guard against a hang, never a wait for something to happen


@pytest.fixture(autouse=True)
def _no_inherited_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CREDENTIAL_ENV, raising=False)


def token(rid: str, chunk: int = 0, numel: int = 16) -> Message:
    return Message(rid, "thinker", {"hidden": torch.full((numel,), float(chunk))}, chunk=chunk)


# ---- the coalescer, with a recording sender ------------------------------------------


@dataclass
class RecordingSender(Sender):
    """Takes every message; records each batch and each lone send, by address."""

    batches: list[tuple[str, list[str]]] = field(default_factory=list)
    alone: list[tuple[str, str]] = field(default_factory=list)
    closed: bool = False

    def __post_init__(self) -> None:
        super().__init__()

    async def send(self, address: str, message: Message) -> None:
        self.alone.append((address, message.request_id))

    async def send_batch(self, address: str, messages: Sequence[Message]) -> list[Verdict]:
        self.batches.append((address, [m.request_id for m in messages]))
        return [Verdict(Outcome.ACK)] * len(messages)

    async def close(self) -> None:
        self.closed = True


class Talking(StreamingStage):
    """A thinker-like stage: its sessions idle (empty steps, nothing to send) until one
    engine call holds all `sessions` of them; from then on each yields one token a step
    for `tokens` steps. Records the sessions of each engine call that made tokens."""

    def __init__(self, tokens: int, sessions: int) -> None:
        super().__init__(spec("thinker", Role.THINKER), "unused", "cpu")
        self.tokens = tokens
        self.sessions = sessions
        self.calls: list[list[str]] = []
        self.go = False

    def load(self) -> None:
        pass

    def step_sessions(self, work: Sequence[tuple[Session, Sequence[Chunk]]]) -> list[StepOutcome]:
        self.go = self.go or len(work) == self.sessions
        results = super().step_sessions(work)
        made = [s.rid for (s, _), r in zip(work, results, strict=True) if r and r.tensors]  # type: ignore[attr-defined]
        if made:
            self.calls.append(made)
        return results

    def open(self, job: StageJob) -> Session:
        stage = self

        class Generating(Session):
            rid = str(job.params["id"])
            made = 0

            def step(self, chunks: Sequence[Chunk]) -> StepResult | None:
                if not stage.go:
                    return StepResult()
                self.made += 1
                return StepResult({"hidden": torch.zeros(4)}, done=self.made == stage.tokens)

            def close(self) -> None:
                pass

        return Generating()


async def test_sixteen_sessions_stepped_together_send_one_batch_per_destination() -> None:
    """16 chats whose steps run in one engine call: each step's 16 tokens leave as one
    send_batch per talker replica, never as 16 sends."""
    stage, sender = Talking(tokens=4, sessions=16), RecordingSender()
    metrics = WorkerMetrics.create("p", "thinker")
    rt = StageRuntime("thinker", stage, Mailbox(), sender, metrics, max_batch=16)
    rt.start()
    talkers = [Destination(stage="talker", address=f"tcp://talker-{i}:8101") for i in range(2)]
    rids = [f"chat-{i}" for i in range(16)]
    jobs = [
        rt.submit(
            SubmitRequest(
                request_id=rid,
                params={"id": rid},
                outputs=[talkers[i % 2], talkers[(i + 1) % 2]],
                timeout_seconds=GUARD,
            )
        )
        for i, rid in enumerate(rids)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(j.task for j in jobs if j.task)), GUARD)
    finally:
        await rt.close()
    assert [j.error for j in jobs] == [""] * 16
    assert [sorted(call) for call in stage.calls] == [sorted(rids)] * 4, stage.calls
    for talker in talkers:
        batches = [sorted(ids) for address, ids in sender.batches if address == talker.address]
        assert batches == [sorted(rids)] * 4, batches
    assert sender.alone == []


async def test_a_lone_message_is_sent_alone_and_a_refusal_fails_only_its_request() -> None:
    class Refusing(RecordingSender):
        async def send_batch(self, address: str, messages: Sequence[Message]) -> list[Verdict]:
            await super().send_batch(address, messages)
            answers = {"b": Verdict(Outcome.REFUSED, "mailbox full"), "c": SEND_ALONE}
            return [answers.get(m.request_id, Verdict(Outcome.ACK)) for m in messages]

    sender = Refusing()
    handoffs = HandOffs(sender)
    await handoffs.send("tcp://x:1", token("lone"))
    assert (sender.batches, sender.alone) == ([], [("tcp://x:1", "lone")])
    results = await asyncio.gather(
        *(handoffs.send("tcp://x:1", token(rid)) for rid in ("a", "b", "c")),
        return_exceptions=True,
    )
    assert results[0] is None
    assert results[2] is None
    assert isinstance(results[1], TransferRefused)
    assert "mailbox full" in str(results[1])
    assert sender.batches == [("tcp://x:1", ["a", "b", "c"])]
    assert sender.alone == [("tcp://x:1", "lone"), ("tcp://x:1", "c")]  # BUSY: again, alone


# ---- each transport ------------------------------------------------------------------


@dataclass
class Counted:
    frames: int = 0

    def stats(self) -> TransferStats:
        def count() -> None:
            self.frames += 1

        return TransferStats(on_frame=count)


@pytest.fixture
def counted() -> Counted:
    return Counted()


async def _queued(mailbox: Mailbox, rid: str) -> Message:
    return await asyncio.wait_for(mailbox.get(rid), GUARD)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_batch_answers_busy_for_a_full_queue_and_delivers_the_others_at_once(
    backend: str, counted: Counted
) -> None:
    mailbox = Mailbox(per_request=1)
    receiver = make_receiver(backend, mailbox)
    await receiver.start()
    sender = make_sender(backend, counted.stats())
    try:
        for rid in ("slow", "a", "b"):
            mailbox.claim(rid)
        await mailbox.put(token("slow", 0))  # its one place is taken: nobody reads it yet
        verdicts = await asyncio.wait_for(
            sender.send_batch(receiver.address, [token("a"), token("slow", 1), token("b")]),
            GUARD,
        )
        assert [v.outcome for v in verdicts] == [Outcome.ACK, Outcome.BUSY, Outcome.ACK]
        assert counted.frames == 1
        for rid in ("a", "b"):
            got = await _queued(mailbox, rid)
            assert torch.equal(got.tensors["hidden"], token(rid).tensors["hidden"])
        # Through HandOffs: "slow" is sent again alone, and waits for room as a lone
        # send does, while the others of its batch are acknowledged.
        handoffs = HandOffs(sender)
        slow = asyncio.create_task(handoffs.send(receiver.address, token("slow", 1)))
        others = asyncio.gather(
            handoffs.send(receiver.address, token("a", 1)),
            handoffs.send(receiver.address, token("b", 1)),
        )
        await asyncio.wait_for(others, GUARD)
        assert not slow.done()  # its queue is still full: its lone send waits
        assert (await _queued(mailbox, "a")).chunk == 1
        assert (await _queued(mailbox, "slow")).chunk == 0  # room: the lone send goes in
        await asyncio.wait_for(slow, GUARD)
        assert (await _queued(mailbox, "slow")).chunk == 1
        assert (await _queued(mailbox, "b")).chunk == 1
        assert mailbox.bytes_held == 0  # nothing reserved for what was answered BUSY
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_message_over_the_mailbox_cap_is_refused_alone(backend: str) -> None:
    mailbox = Mailbox(max_bytes=64 << 10)
    receiver = make_receiver(backend, mailbox)
    await receiver.start()
    sender = make_sender(backend)
    try:
        for rid in ("a", "big", "b"):
            mailbox.claim(rid)
        big = token("big", numel=12 << 10)  # 48 KiB: inline over UCX too
        hog = Message("hog", "x", {"x": torch.zeros(4 << 10)})  # 16 KiB held
        mailbox.claim("hog")
        await mailbox.put(hog)
        verdicts = await sender.send_batch(receiver.address, [token("a"), big, token("b")])
        assert [v.outcome for v in verdicts] == [Outcome.ACK, Outcome.REFUSED, Outcome.ACK]
        assert "mailbox full" in verdicts[1].reason
        assert "big" in verdicts[1].reason
        assert {(await _queued(mailbox, rid)).request_id for rid in ("a", "b")} == {"a", "b"}
        # The connection goes on: the next batch is taken whole.
        verdicts = await sender.send_batch(receiver.address, [token("a", 1), token("b", 1)])
        assert [v.outcome for v in verdicts] == [Outcome.ACK, Outcome.ACK]
    finally:
        await sender.close()
        await receiver.close()


def test_a_receiver_before_batches_rejects_a_batch_header() -> None:
    """What an older receiver runs: a batch header has no `tensors`, so decode_header
    refuses it (CodecError), and the receiver closes the connection."""
    raw = msgpack.packb({"batch": [{"request_id": "a", "tensors": []}]}, use_bin_type=True)
    with pytest.raises(CodecError):
        decode_header(raw)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_older_receiver_gets_every_message_one_by_one(
    backend: str, counted: Counted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver that reads frames as it did before batches closes the connection on a
    batch: each message goes again alone, and the address is sent no more batches."""
    module = "omnipipe.transfer.tcp" if backend == "tcp" else "omnipipe.transfer.ucx_receiver"
    monkeypatch.setattr(f"{module}.decode_frame_header", decode_header)
    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox)
    await receiver.start()
    sender = make_sender(backend, counted.stats())
    handoffs = HandOffs(sender)
    try:
        for chunk in range(2):
            await asyncio.wait_for(
                asyncio.gather(*(handoffs.send(receiver.address, token(r, chunk)) for r in "abc")),
                GUARD,
            )
        assert not sender.takes_batches(receiver.address)
        # One rejected batch, then six lone messages.
        assert counted.frames == 1 + 6
        for rid in "abc":
            assert [(await _queued(mailbox, rid)).chunk for _ in range(2)] == [0, 1]
    finally:
        await handoffs.close()
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_batches_and_lone_messages_are_counted_as_frames(
    backend: str, counted: Counted
) -> None:
    mailbox, received = Mailbox(), Counted()
    receiver = make_receiver(backend, mailbox, stats=received.stats())
    await receiver.start()
    sender = make_sender(backend, counted.stats())
    handoffs = HandOffs(sender)
    try:
        rids = [f"r{i}" for i in range(8)]
        for chunk in range(3):
            await asyncio.wait_for(
                asyncio.gather(*(handoffs.send(receiver.address, token(r, chunk)) for r in rids)),
                GUARD,
            )
        await handoffs.send(receiver.address, token("alone"))
        assert counted.frames == 4  # 25 hand-offs in 4 transport messages
        assert received.frames == 4
        for rid in rids:
            assert [(await _queued(mailbox, rid)).chunk for _ in range(3)] == [0, 1, 2]
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_hand_off_before_its_submission_waits_for_the_claim_past_a_flood(
    backend: str,
) -> None:
    """Inputs nobody will claim fill the unclaimed room; a real request's input that comes
    before its own submission is refused for it, tried again, and taken once the
    submission's claim arrives. An input whose request is never claimed still fails, in
    about the 1.5 s of tries, with the mailbox's reason."""
    mailbox = Mailbox(max_bytes=64 << 10)
    receiver = make_receiver(backend, mailbox)
    await receiver.start()
    handoffs = HandOffs(make_sender(backend))
    flood = Message("flood", "x", {"x": torch.zeros(mailbox.max_unclaimed_bytes // 4 - 1024)})
    try:
        await mailbox.put(flood)  # unclaimed, and most of the unclaimed room
        sent = asyncio.create_task(handoffs.send(receiver.address, token("real", numel=2048)))
        await asyncio.sleep(0.2)  # its first tries were refused meanwhile
        assert not sent.done()
        mailbox.claim("real")  # the submission arrives
        await asyncio.wait_for(sent, GUARD)
        assert (await _queued(mailbox, "real")).request_id == "real"
        started = asyncio.get_running_loop().time()
        with pytest.raises(TransferRefused, match="which no job has claimed yet"):
            await handoffs.send(receiver.address, token("never", numel=2048))
        assert 1.0 < asyncio.get_running_loop().time() - started < GUARD
    finally:
        await handoffs.close()
        await handoffs.sender.close()
        await receiver.close()
