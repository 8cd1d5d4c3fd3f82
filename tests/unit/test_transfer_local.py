"""Hand-offs by reference between stages of one process (docs/design/colocation.md,
section 3): LocalFirstSender delivers into a co-located receiver's real Mailbox as
TcpReceiver would (back-pressure, refusals, late chunks dropped), shares memory where
that pins nothing else, and sends unknown addresses over the network."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

from omnipipe.families.bagel.config import LlmShape
from omnipipe.families.bagel.context import FULL, NO_TEXT
from omnipipe.families.bagel.kv_blocks import pack, unpack
from omnipipe.families.bagel.mot import ContextKV
from omnipipe.transfer import (
    CHECK_ALIASING_ENV,
    CREDENTIAL_ENV,
    AliasingError,
    LocalExchange,
    LocalFirstSender,
    Mailbox,
    Message,
    TransferRefused,
    TransferStats,
    make_receiver,
    make_sender,
)
from omnipipe.transfer.base import Outcome
from omnipipe.transfer.handoffs import HandOffs
from tests.unit.test_handoffs import RecordingSender

pytestmark = pytest.mark.timeout(60)
GUARD = 20  # seconds: only a guard against a hang, never a wait for something to happen
HERE = "tcp://127.0.0.1:8102"
ELSEWHERE = "tcp://10.0.0.9:8101"


@pytest.fixture(autouse=True)
def _no_inherited_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CREDENTIAL_ENV, raising=False)
    monkeypatch.delenv(CHECK_ALIASING_ENV, raising=False)


@dataclass
class Group:
    """One co-located receiver at HERE, and a sender that counts its local bytes."""

    mailbox: Mailbox
    exchange: LocalExchange
    network: RecordingSender
    sender: LocalFirstSender
    local_bytes: list[int]
    received: list[tuple[int, float]]


def group(mailbox: Mailbox | None = None, check_aliasing: bool = False) -> Group:
    mailbox = Mailbox() if mailbox is None else mailbox  # an empty one is falsy
    exchange = LocalExchange(check_aliasing)
    received: list[tuple[int, float]] = []
    exchange.register(HERE, mailbox, TransferStats(lambda n, s: received.append((n, s))))
    network = RecordingSender()
    local_bytes: list[int] = []
    sender = LocalFirstSender(network, exchange, on_local=local_bytes.append)
    return Group(mailbox, exchange, network, sender, local_bytes, received)


def chunk(rid: str, i: int = 0, numel: int = 4) -> Message:
    return Message(rid, "thinker", {"hidden": torch.full((numel,), float(i))}, chunk=i)


async def take(mailbox: Mailbox, rid: str) -> Message:
    return await asyncio.wait_for(mailbox.get(rid), GUARD)


async def test_the_receiver_gets_the_senders_memory_in_its_own_message() -> None:
    g = group()
    x = torch.randn(3, 5)
    sent = Message("r1", "encode", {"x": x}, chunk=2, final=False, meta={"sizes": [1, 2]})
    await g.sender.send(HERE, sent)
    got = await take(g.mailbox, "r1")
    assert got is not sent
    assert got.tensors["x"].data_ptr() == x.data_ptr()
    assert (got.source, got.chunk, got.final) == ("encode", 2, False)
    got.tensors["extra"] = torch.zeros(1)
    got.meta["sizes"].append(3)
    assert sent.tensors.keys() == {"x"}
    assert sent.meta == {"sizes": [1, 2]}
    assert got.received_ns is not None


async def test_a_view_arrives_compacted_in_its_own_storage() -> None:
    g = group()
    base = torch.arange(1000, dtype=torch.float32)
    window = base[100:110]
    transposed = base[:12].view(3, 4).t()
    await g.sender.send(HERE, Message("r1", "s", {"window": window, "t": transposed}))
    got = (await take(g.mailbox, "r1")).tensors
    assert torch.equal(got["window"], window)
    assert got["window"].untyped_storage().nbytes() == 40
    assert got["window"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert torch.equal(got["t"], transposed)
    assert got["t"].is_contiguous()
    assert got["t"].untyped_storage().nbytes() == 48


async def test_a_requests_ninth_message_waits_for_room() -> None:
    g = group()
    for i in range(8):
        await asyncio.wait_for(g.sender.send(HERE, chunk("r1", i)), GUARD)
    ninth = asyncio.create_task(g.sender.send(HERE, chunk("r1", 8)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not ninth.done()
    assert (await take(g.mailbox, "r1")).chunk == 0
    await asyncio.wait_for(ninth, GUARD)
    chunks = [(await take(g.mailbox, "r1")).chunk for _ in range(8)]
    assert chunks == list(range(1, 9))


async def test_a_full_mailbox_refuses_a_send_and_answers_refused_in_a_batch() -> None:
    g = group(Mailbox(max_bytes=200))  # unclaimed inputs may hold 150 bytes of it
    await g.sender.send(HERE, chunk("r1", 0, numel=25))  # 100 bytes
    with pytest.raises(TransferRefused, match=rf"{HERE} refused request r2: mailbox full"):
        await g.sender.send(HERE, chunk("r2", 0, numel=16))
    verdicts = await g.sender.send_batch(HERE, [chunk("r3", 0, numel=4), chunk("r4", 0, 16)])
    assert [v.outcome for v in verdicts] == [Outcome.ACK, Outcome.REFUSED]
    assert "mailbox full" in verdicts[1].reason
    assert g.mailbox.bytes_held == 100 + 16
    assert g.local_bytes == [100, 16]


async def test_a_batch_leaves_a_full_queue_busy_and_delivers_the_rest() -> None:
    g = group()
    for i in range(8):
        await g.sender.send(HERE, chunk("r1", i))
    verdicts = await g.sender.send_batch(HERE, [chunk("r1", 8), chunk("r2", 0), chunk("r2", 1)])
    assert [v.outcome for v in verdicts] == [Outcome.BUSY, Outcome.ACK, Outcome.ACK]
    assert [(await take(g.mailbox, "r2")).chunk for _ in range(2)] == [0, 1]


async def test_messages_for_an_ended_request_drop() -> None:
    g = group()
    g.mailbox.discard("r1")
    await g.sender.send(HERE, chunk("r1", 0))
    verdicts = await g.sender.send_batch(HERE, [chunk("r1", 1), chunk("r1", 2)])
    assert [v.outcome for v in verdicts] == [Outcome.ACK, Outcome.ACK]
    assert g.mailbox.bytes_held == 0
    assert len(g.mailbox) == 0
    assert g.local_bytes == []
    assert g.network.alone == []


async def test_on_local_counts_bytes_and_the_receivers_stats_see_each_message() -> None:
    g = group()
    await g.sender.send(HERE, chunk("r1", 0, numel=10))
    await g.sender.send_batch(HERE, [chunk("r2", 0, numel=3), chunk("r3", 0, numel=5)])
    assert g.local_bytes == [40, 12, 20]
    assert [n for n, _ in g.received] == [40, 12, 20]
    assert all(seconds >= 0 for _, seconds in g.received)


async def test_unknown_addresses_go_to_the_network_sender() -> None:
    g = group()
    assert g.sender.is_local(HERE)
    assert not g.sender.is_local(ELSEWHERE)
    await g.sender.send(ELSEWHERE, chunk("r1"))
    await g.sender.send_batch(ELSEWHERE, [chunk("r2"), chunk("r3")])
    assert g.network.alone == [(ELSEWHERE, "r1")]
    assert g.network.batches == [(ELSEWHERE, ["r2", "r3"])]
    assert len(g.mailbox) == 0
    assert g.local_bytes == []
    g.exchange.unregister(HERE)
    await g.sender.send(HERE, chunk("r4"))
    assert g.network.alone[-1] == (HERE, "r4")
    await g.sender.close()
    assert g.network.closed


async def test_unknown_addresses_cross_a_real_tcp_socket() -> None:
    remote = Mailbox()
    receiver = make_receiver("tcp", remote)
    await receiver.start()
    crossed: list[int] = []
    network = make_sender("tcp", TransferStats(lambda n, _s: crossed.append(n)))
    g = group()
    sender = LocalFirstSender(network, g.exchange, on_local=g.local_bytes.append)
    x = torch.arange(6, dtype=torch.float32)
    try:
        assert not sender.is_local(receiver.address)
        await sender.send(receiver.address, Message("r1", "s", {"x": x}))
        got = (await take(remote, "r1")).tensors["x"]
        assert torch.equal(got, x)
        assert got.data_ptr() != x.data_ptr()
        assert crossed == [24]
        assert g.local_bytes == []
    finally:
        await sender.close()
        await receiver.close()


async def test_streaming_chunks_through_handoffs_arrive_in_one_local_batch() -> None:
    g = group()
    handoffs = HandOffs(g.sender)
    await asyncio.wait_for(
        asyncio.gather(*(handoffs.send(HERE, chunk(f"r{i}", i)) for i in range(4))), GUARD
    )
    assert [(await take(g.mailbox, f"r{i}")).chunk for i in range(4)] == [0, 1, 2, 3]
    assert g.network.alone == []
    assert g.network.batches == []
    assert g.local_bytes == [16] * 4


def tiny_llm() -> LlmShape:
    return LlmShape(32, 64, 2, 4, 2, 100, 1e-6, 10000.0)


def caches(tokens: int) -> ContextKV:
    keys = torch.randn(2, tokens, 2, 8)
    return ContextKV(keys, keys + 1)


async def test_kv_blocks_go_by_reference_without_rows_and_count_against_the_cap() -> None:
    llm = tiny_llm()
    sent = {FULL: caches(20), NO_TEXT: caches(3)}
    blocks, layout = pack(sent, torch.float32)
    block_bytes = sum(b.numel() * b.element_size() for b in blocks)
    g = group()
    message = Message("r1", "think", {"kv_layout": layout}, blocks=blocks)
    await g.sender.send(HERE, message)
    got = await take(g.mailbox, "r1")
    assert [b.data_ptr() for b in got.blocks] == [b.data_ptr() for b in blocks]
    assert got.block_ids == []
    assert got.on_drop is None
    assert g.local_bytes == [layout.numel() * 8 + block_bytes]
    # What the generate stage does with a job's blocks (families/bagel/image.py: caches).
    out = unpack(got.blocks, got.tensors["kv_layout"], llm, 2, torch.float32)
    assert torch.equal(out[FULL].keys, sent[FULL].keys)
    assert torch.equal(out[NO_TEXT].values, sent[NO_TEXT].values)

    small = group(Mailbox(max_bytes=block_bytes))
    with pytest.raises(TransferRefused, match="mailbox full"):
        await small.sender.send(HERE, message)


async def test_an_in_place_write_after_delivery_raises_aliasing_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CHECK_ALIASING_ENV, "1")
    mailbox = Mailbox()
    exchange = LocalExchange()
    exchange.register(HERE, mailbox)
    sender = LocalFirstSender(RecordingSender(), exchange)
    x, y = torch.zeros(4), torch.zeros(4)
    await sender.send(HERE, Message("r1", "thinker", {"hidden": x, "audio": y}))
    got = await take(mailbox, "r1")
    exchange.check()
    x.add_(1)  # the sender reuses its buffer
    named = rf"'hidden' of request r1 from stage thinker to {HERE}"
    with pytest.raises(AliasingError, match=named):
        exchange.check()
    fresh = LocalExchange()
    fresh.register(HERE, mailbox)
    await LocalFirstSender(RecordingSender(), fresh).send(HERE, Message("r2", "talker", {"c": y}))
    got = await take(mailbox, "r2")
    got.tensors["c"].mul_(2)  # the receiver writes into its input
    with pytest.raises(AliasingError, match="'c' of request r2 from stage talker"):
        fresh.check()


async def test_without_the_check_nothing_is_recorded() -> None:
    g = group()
    x = torch.zeros(4)
    await g.sender.send(HERE, Message("r1", "s", {"x": x}))
    x.add_(1)
    g.exchange.check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_tensors_stay_on_their_device_once_written() -> None:
    g = group()
    x = torch.randn(1 << 20, device="cuda")
    y = x * 2  # queued on the current stream: delivery waits for it
    await g.sender.send(HERE, Message("r1", "s", {"y": y, "view": x[1:5]}))
    got = (await take(g.mailbox, "r1")).tensors
    assert got["y"].is_cuda
    assert got["y"].data_ptr() == y.data_ptr()
    assert got["view"].is_cuda
    assert got["view"].untyped_storage().nbytes() == 16
    assert torch.equal(got["y"], x * 2)
