"""Round trips over both backends in one process, on loopback."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from omnipipe.transfer import Mailbox, Message, make_receiver, make_sender
from omnipipe.transfer.codec import CodecError, rebuild

os.environ.setdefault("UCX_NET_DEVICES", "lo")
BACKENDS = ["tcp", "ucx"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int64]
SHAPES = [(), (0,), (7,), (3, 5), (2, 3, 4, 5)]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 1000)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


async def roundtrip(backend: str, messages: list[Message]) -> list[Message]:
    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox)
    await receiver.start()
    sender = make_sender(backend)
    try:
        for m in messages:
            await sender.send(receiver.address, m)
        return [await asyncio.wait_for(mailbox.get(m.request_id), 10) for m in messages]
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_dtypes_and_shapes_round_trip(backend: str) -> None:
    tensors = {f"{d}-{s}": sample(d, s) for d in DTYPES for s in SHAPES}
    [got] = await roundtrip(
        backend, [Message("r1", "encode", tensors, chunk=3, final=False, meta={"mask_len": 5})]
    )
    assert (got.request_id, got.source, got.chunk, got.final) == ("r1", "encode", 3, False)
    assert got.meta == {"mask_len": 5}
    assert got.tensors.keys() == tensors.keys()
    for name, t in tensors.items():
        assert got.tensors[name].dtype == t.dtype, name
        assert got.tensors[name].shape == t.shape, name
        assert torch.equal(got.tensors[name], t), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_64_mib_payload(backend: str) -> None:
    big = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
    [got] = await roundtrip(backend, [Message("big", "denoise", {"latents": big})])
    assert got.tensors["latents"].nbytes == 64 << 20
    assert torch.equal(got.tensors["latents"], big)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_slow_consumer_applies_back_pressure(backend: str) -> None:
    mailbox = Mailbox(per_request=2)
    receiver = make_receiver(backend, mailbox)
    await receiver.start()
    sender = make_sender(backend)
    chunk = {"x": torch.zeros(1024)}
    try:

        async def produce() -> int:
            for i in range(6):
                await sender.send(receiver.address, Message("r", "s", chunk, chunk=i))
            return 6

        producer = asyncio.create_task(produce())
        await asyncio.sleep(1.0)
        # Two queued plus one held by the blocked receiver: the producer is stalled.
        assert not producer.done()
        got = [(await mailbox.get("r")).chunk for _ in range(6)]
        assert await asyncio.wait_for(producer, 10) == 6
        assert got == list(range(6))
    finally:
        await sender.close()
        await receiver.close()


def test_corrupt_specs_are_rejected() -> None:
    with pytest.raises(CodecError):
        rebuild({"name": "x", "dtype": "float32", "shape": [4], "nbytes": 16}, bytearray(8))
    with pytest.raises(CodecError):
        rebuild({"name": "x", "dtype": "object", "shape": [1], "nbytes": 8}, bytearray(8))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_idle_transfer_does_not_spin(backend: str) -> None:
    """After a hand-off, an idle receiver and sender must not burn CPU (ucxx busy-polls
    any receive left pending, which once starved the whole machine)."""
    import resource

    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox)
    await receiver.start()
    sender = make_sender(backend)
    try:
        await sender.send(receiver.address, Message("r", "s", {"x": torch.zeros(8)}))
        await mailbox.get("r")
        before = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.sleep(2.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        assert cpu < 0.5, f"{cpu:.2f}s of CPU in 2s idle"
    finally:
        await sender.close()
        await receiver.close()


# ---- the authenticated, least-exposed data plane -------------------------------------

CREDENTIAL = "pipeline-credential-for-tests"


@pytest.fixture(autouse=True)
def _no_inherited_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    from omnipipe.transfer import CREDENTIAL_ENV

    monkeypatch.delenv(CREDENTIAL_ENV, raising=False)


def test_transfer_reads_the_credential_the_operator_sets() -> None:
    from omnipipe.api.constants import CREDENTIAL_ENV as API_ENV
    from omnipipe.transfer import CREDENTIAL_ENV

    assert CREDENTIAL_ENV == API_ENV


def _listening_sockets() -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket this process holds, from /proc."""
    import ipaddress
    from pathlib import Path

    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            raw_ip, raw_port = local.split(":")
            packed = bytes.fromhex(raw_ip)
            # /proc prints each 32-bit word in host (little-endian) order.
            packed = b"".join(packed[i : i + 4][::-1] for i in range(0, width, 4))
            found.append((str(ipaddress.ip_address(packed)), int(raw_port, 16)))
    return found


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_loopback_receiver_listens_on_loopback_only(backend: str) -> None:
    before = set(_listening_sockets())
    receiver = make_receiver(backend, Mailbox(), "127.0.0.1", credential=CREDENTIAL)
    await receiver.start()
    sender = make_sender(backend, credential=CREDENTIAL)
    try:
        assert receiver.bound is not None
        assert receiver.bound[0] == "127.0.0.1"
        assert receiver.address == f"{backend}://127.0.0.1:{receiver.bound[1]}"
        # Nothing this process listens on (ucxx and UCX's own transports included) is
        # reachable from another interface, before or after a connection.
        await sender.send(receiver.address, Message("r", "s", {"x": torch.zeros(1 << 16)}))
        opened = set(_listening_sockets()) - before
        assert ("127.0.0.1", receiver.bound[1]) in opened
        assert all(ip == "127.0.0.1" for ip, _ in opened), opened
    finally:
        await sender.close()
        await receiver.close()


async def _refused(backend: str, receiver_cred: str | None, sender_cred: str | None) -> Mailbox:
    from omnipipe.transfer import TransferRefused

    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox, credential=receiver_cred)
    await receiver.start()
    sender = make_sender(backend, credential=sender_cred)
    try:
        with pytest.raises(TransferRefused, match="credential"):
            await sender.send(receiver.address, Message("r", "s", {"x": torch.ones(1 << 17)}))
        await asyncio.sleep(0.2)
        return mailbox
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("receiver_cred", "sender_cred"),
    [(CREDENTIAL, None), (CREDENTIAL, "wrong"), (None, CREDENTIAL), ("other", CREDENTIAL)],
    ids=["sender-without", "sender-wrong", "receiver-without", "receiver-other"],
)
async def test_a_connection_without_the_credential_is_refused(
    backend: str, receiver_cred: str | None, sender_cred: str | None
) -> None:
    mailbox = await _refused(backend, receiver_cred, sender_cred)
    assert len(mailbox) == 0
    assert mailbox.bytes_held == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_with_the_credential_it_succeeds(backend: str) -> None:
    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox, credential=CREDENTIAL)
    await receiver.start()
    sender = make_sender(backend, credential=CREDENTIAL)
    big = torch.arange(1 << 18, dtype=torch.float32)
    try:
        for i in range(3):  # the second and third reuse the authenticated connection
            await sender.send(receiver.address, Message("r", "s", {"x": big + i}, chunk=i))
        for i in range(3):
            got = await asyncio.wait_for(mailbox.get("r"), 10)
            assert torch.equal(got.tensors["x"], big + i)
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_credential_is_read_from_the_environment(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omnipipe.transfer import CREDENTIAL_ENV, TransferRefused

    monkeypatch.setenv(CREDENTIAL_ENV, CREDENTIAL)
    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox)
    await receiver.start()
    with_env = make_sender(backend)
    without = make_sender(backend, credential="not-it")
    try:
        await with_env.send(receiver.address, Message("r", "s", {"x": torch.ones(4)}))
        assert torch.equal((await mailbox.get("r")).tensors["x"], torch.ones(4))
        with pytest.raises(TransferRefused):
            await without.send(receiver.address, Message("r", "s", {"x": torch.ones(4)}))
    finally:
        await with_env.close()
        await without.close()
        await receiver.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_frames_without_the_handshake_are_dropped_unread(backend: str) -> None:
    """A raw client that skips the handshake and sends a frame is cut off; nothing it
    sent reaches the mailbox."""
    from omnipipe.transfer.auth import MAGIC, NONCE_BYTES, PROOF_BYTES, REFUSED
    from omnipipe.transfer.codec import encode_header
    from omnipipe.transfer.frames import frame_header
    from omnipipe.transfer.tcp import _LEN

    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox, credential=CREDENTIAL)
    await receiver.start()
    try:
        assert receiver.bound is not None
        reader, writer = await asyncio.open_connection(*receiver.bound)
        header, buffers = frame_header(Message("evil", "s", {"x": torch.ones(16)}))
        raw = encode_header(header)
        frame = _LEN.pack(len(raw)) + raw + b"".join(bytes(b) for b in buffers)
        hello = await asyncio.wait_for(reader.readexactly(len(MAGIC) + NONCE_BYTES), 10)
        assert hello.startswith(MAGIC)
        # A frame where the proof belongs: refused, and the connection is closed.
        writer.write(frame[: NONCE_BYTES + PROOF_BYTES])
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == REFUSED
        writer.close()
        assert len(mailbox) == 0
        assert mailbox.bytes_held == 0
    finally:
        await receiver.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_destination_that_cannot_prove_the_credential_gets_no_tensors(
    backend: str,
) -> None:
    """An address a submission names that is no peer of this pipeline: it accepts
    anything but cannot answer with the credential. The sender refuses it and sends it
    nothing beyond its own proof."""
    from omnipipe.transfer import TransferRefused
    from omnipipe.transfer.auth import ACCEPTED, MAGIC, NONCE_BYTES, PROOF_BYTES

    received = bytearray()

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(MAGIC + os.urandom(NONCE_BYTES))
        await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
        writer.write(ACCEPTED + os.urandom(PROOF_BYTES))
        while chunk := await reader.read(1 << 16):
            received.extend(chunk)
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sender = make_sender(backend, credential=CREDENTIAL)
    try:
        with pytest.raises(TransferRefused, match="not a peer of this pipeline"):
            await sender.send(
                f"{backend}://127.0.0.1:{port}", Message("r", "s", {"x": torch.ones(1 << 17)})
            )
        await asyncio.sleep(0.2)
        assert received == b""
    finally:
        await sender.close()
        server.close()
        await server.wait_closed()


def test_mailbox_cap_counts_queued_and_reserved_bytes() -> None:
    from omnipipe.transfer import MailboxFull

    async def run() -> None:
        mailbox = Mailbox(max_bytes=1000)
        charge = mailbox.reserve("a", 600)
        assert charge == 600
        assert mailbox.bytes_held == 600
        with pytest.raises(MailboxFull, match="1000-byte cap"):
            mailbox.reserve("b", 401)
        mailbox.release(charge)
        await mailbox.put(Message("a", "s", {"x": torch.zeros(100, dtype=torch.uint8)}))
        assert mailbox.bytes_held == 100
        await mailbox.get("a")
        assert mailbox.bytes_held == 0
        await mailbox.put(Message("b", "s", {"x": torch.zeros(100, dtype=torch.uint8)}))
        mailbox.discard("b")
        assert mailbox.bytes_held == 0
        assert mailbox.reserve("b", 10) is None  # a late chunk of a finished request

    asyncio.run(run())


def test_unclaimed_inputs_hold_a_share_and_claimed_requests_keep_the_rest() -> None:
    """A flood of inputs for requests no job asks for fills only the unclaimed share: a
    request a job waits on still gets its inputs, up to the whole cap."""
    from omnipipe.transfer import UNCLAIMED_SHARE, MailboxFull

    def chunk(n: int) -> dict[str, torch.Tensor]:
        return {"x": torch.zeros(n, dtype=torch.uint8)}

    async def run() -> None:
        mailbox = Mailbox(max_bytes=1000)
        share = int(1000 * UNCLAIMED_SHARE)
        assert mailbox.max_unclaimed_bytes == share < 1000
        await mailbox.put(Message("flood-1", "s", chunk(share - 10)))
        with pytest.raises(MailboxFull, match=f"{share} bytes that unclaimed inputs may hold"):
            await mailbox.put(Message("flood-2", "s", chunk(11)))
        waiting = asyncio.create_task(mailbox.get("real"))  # a job claims "real"
        await asyncio.sleep(0)
        await mailbox.put(Message("real", "s", chunk(1000 - share + 10)))
        assert mailbox.bytes_held == 1000
        assert (await asyncio.wait_for(waiting, 5)).nbytes == 1000 - share + 10
        with pytest.raises(MailboxFull, match="1000-byte cap"):  # the cap still holds
            mailbox.reserve("real", 1000 - share + 11)
        # Claiming moves a request's queued bytes out of the unclaimed share.
        assert mailbox.unclaimed_bytes_held == share - 10
        assert (await mailbox.get("flood-1")).nbytes == share - 10
        assert mailbox.unclaimed_bytes_held == mailbox.bytes_held == 0
        # Discarding or releasing gives the share back too, held or reserved.
        await mailbox.put(Message("flood-2", "s", chunk(share)))
        charge = mailbox.reserve("flood-3", 0)
        assert charge is not None
        mailbox.discard("flood-2")
        mailbox.release(charge)
        assert mailbox.unclaimed_bytes_held == mailbox.bytes_held == 0
        charge = mailbox.reserve("flood-4", share)
        assert charge is not None
        mailbox.release(charge)
        assert mailbox.unclaimed_bytes_held == mailbox.bytes_held == 0
        # A job claimed at submission gets its inputs while the unclaimed share is full.
        await mailbox.put(Message("flood-5", "s", chunk(share)))
        mailbox.claim("early")
        await mailbox.put(Message("early", "s", chunk(1000 - share)))
        assert (await mailbox.get("early")).nbytes == 1000 - share
        mailbox.discard("early")
        mailbox.claim("early")  # ended here: claiming it again opens nothing
        assert mailbox.reserve("early", 1) is None

    asyncio.run(run())


def test_only_unclaimed_inputs_expire() -> None:
    async def run() -> None:
        mailbox = Mailbox(ttl_seconds=0.05)
        chunk = {"x": torch.zeros(10, dtype=torch.uint8)}
        await mailbox.put(Message("unclaimed", "s", chunk))
        await mailbox.put(Message("running", "s", chunk))
        await mailbox.get("running")  # a job took its first input: the request is claimed
        await mailbox.put(Message("running", "s", chunk, chunk=1))
        await asyncio.sleep(0.1)
        assert mailbox.sweep() == 1
        assert mailbox.bytes_held == 10
        assert (await mailbox.get("running")).chunk == 1

    asyncio.run(run())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_flood_is_refused_under_the_cap_and_a_request_succeeds_after(
    backend: str,
) -> None:
    from omnipipe.transfer import TransferRefused

    cap = 8 << 20
    mailbox = Mailbox(max_bytes=cap, ttl_seconds=0.5)
    receiver = make_receiver(backend, mailbox, credential=CREDENTIAL)
    await receiver.start()
    flooder = make_sender(backend, credential=CREDENTIAL)
    sender = make_sender(backend, credential=CREDENTIAL)
    one_mib = torch.zeros(1 << 18, dtype=torch.float32)
    refused = 0
    reasons: set[str] = set()
    try:
        for i in range(40):  # 40 MiB of inputs nobody will claim, into an 8 MiB mailbox
            try:
                await flooder.send(receiver.address, Message(f"flood-{i}", "s", {"x": one_mib}))
            except TransferRefused as exc:
                reasons.add(str(exc).partition(f"refused request flood-{i}: ")[2][:12])
                refused += 1
            assert mailbox.bytes_held <= cap
        assert refused >= 32
        assert reasons == {"mailbox full"}
        # The refused connection stays usable, and says why again.
        with pytest.raises(TransferRefused, match="cap"):
            await sender.send(receiver.address, Message("legit", "s", {"x": one_mib}))
        # Unclaimed inputs expire; then the legitimate request goes through.
        await asyncio.sleep(0.6)
        assert mailbox.sweep() > 0
        assert mailbox.bytes_held == 0
        await sender.send(receiver.address, Message("legit", "s", {"x": one_mib + 1}))
        got = await asyncio.wait_for(mailbox.get("legit"), 10)
        assert torch.equal(got.tensors["x"], one_mib + 1)
    finally:
        await flooder.close()
        await sender.close()
        await receiver.close()


_UCX_LISTENERS = """
import asyncio, json, os, sys
import torch
from omnipipe.transfer import Mailbox, Message, make_receiver, make_sender
from tests.unit.test_transfer import _listening_sockets

async def main() -> None:
    receiver = make_receiver("ucx", Mailbox(), "127.0.0.1", credential="c")
    await receiver.start()
    sender = make_sender("ucx", credential="c")
    await sender.send(receiver.address, Message("r", "s", {"x": torch.ones(1 << 18)}))
    print(json.dumps([os.environ.get("UCX_NET_DEVICES"), _listening_sockets()]))
    await sender.close()
    await receiver.close()

os.environ.pop("UCX_NET_DEVICES", None)  # set by importing the test module
asyncio.run(main())
"""


@pytest.mark.timeout(120)
def test_ucx_given_loopback_keeps_its_own_transports_on_loopback() -> None:
    """UCX's transports listen on every network device unless told otherwise; a receiver
    given 127.0.0.1 (and nothing in UCX_NET_DEVICES) restricts them to lo."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    out = subprocess.run(
        [sys.executable, "-c", _UCX_LISTENERS],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    ).stdout
    devices, listening = json.loads(out.strip().splitlines()[-1])
    assert devices == "lo"
    assert len(listening) >= 2  # ours and UCX's TCP transport
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening


def test_the_device_that_holds_an_address() -> None:
    from omnipipe.transfer.ucx import _interface_of

    assert _interface_of("127.0.0.1") == "lo"
    assert _interface_of("localhost") == "lo"
    assert _interface_of("203.0.113.77") is None  # TEST-NET-3: held by no device here


# ---- KV blocks, buffer reuse, a peer that dies -----------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_kv_blocks_land_in_the_receivers_block_table(backend: str) -> None:
    """Blocks scattered through a paged cache arrive, in order, in free rows of the
    receiver's table, beside ordinary tensors; freed rows are used again."""
    from omnipipe.transfer import BlockTable

    table = BlockTable(num_blocks=96, block_bytes=16 * 1024)
    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox, block_table=table)
    await receiver.start()
    sender = make_sender(backend)
    cache = torch.randn(200, 4096)  # 200 blocks of 16 KiB, float32
    picked = [int(i) for i in torch.randperm(200)[:64]]
    big = torch.randn(1 << 18)  # 1 MiB: travels outside the control message
    try:
        await sender.send(
            receiver.address,
            Message(
                "kv",
                "thinker",
                {"big": big, "len": torch.tensor([64])},
                blocks=[cache[i] for i in picked],
            ),
        )
        got = await asyncio.wait_for(mailbox.get("kv"), 10)
        assert len(got.block_ids) == 64
        assert len(set(got.block_ids)) == 64
        assert table.free_blocks == 96 - 64
        for row, i, block in zip(got.block_ids, picked, got.blocks, strict=True):
            assert torch.equal(table.storage[row].view(torch.float32), cache[i])
            assert block.data_ptr() == table.storage[row].data_ptr()  # no copy out
        assert torch.equal(got.tensors["big"], big)
        table.free(got.block_ids)
        await sender.send(receiver.address, Message("kv2", "thinker", {}, blocks=[cache[0]]))
        again = await asyncio.wait_for(mailbox.get("kv2"), 10)
        assert again.block_ids[0] in got.block_ids
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_kv_blocks_land_in_rows_that_are_not_adjacent(backend: str) -> None:
    """A table whose free rows are scattered (freed out of order) still gets each block
    in its own row, in order (ucx: received in one piece, then scattered)."""
    from omnipipe.transfer import BlockTable

    table = BlockTable(num_blocks=16, block_bytes=1024)
    held = table.allocate(16, 1024)
    table.free(held[1::3] + held[0::3][::-1])  # 11 free rows, none adjacent in order
    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox, block_table=table)
    await receiver.start()
    sender = make_sender(backend)
    blocks = [torch.full((256,), float(i)) for i in range(8)]
    try:
        await sender.send(receiver.address, Message("r", "s", {}, blocks=blocks))
        got = await asyncio.wait_for(mailbox.get("r"), 10)
        assert table.run(got.block_ids) is None  # the rows really are scattered
        for row, block in zip(got.block_ids, blocks, strict=True):
            assert torch.equal(table.storage[row].view(torch.float32), block)
        assert [b.data_ptr() for b in got.blocks] == [
            table.storage[r].data_ptr() for r in got.block_ids
        ]
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_declined_message_with_tensors_and_blocks_leaves_the_connection_clean(
    backend: str,
) -> None:
    """A refused message (no rows) and a dropped one (its request over) each carry a
    large tensor and KV blocks; the next message on the same connection arrives whole,
    not with their leftovers."""
    from omnipipe.transfer import BlockTable, TransferRefused

    table = BlockTable(num_blocks=4, block_bytes=1024)
    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox, block_table=table)
    await receiver.start()
    sender = make_sender(backend)
    big = torch.full((1 << 18,), 1.0)  # 1 MiB: its own DATA message
    try:
        blocks = [torch.full((256,), 9.0)] * 5
        with pytest.raises(TransferRefused, match="block table full"):
            await sender.send(receiver.address, Message("r", "s", {"x": big}, blocks=blocks))
        await sender.send(receiver.address, Message("done", "s", {"x": big}))
        mailbox.discard("done")  # over here: a late chunk is dropped unread
        late = Message("done", "s", {"x": big * 2}, blocks=[torch.full((256,), 8.0)], chunk=1)
        await sender.send(receiver.address, late)
        want = [torch.full((256,), float(i)) for i in range(3)]
        await sender.send(receiver.address, Message("next", "s", {"x": big * 3}, blocks=want))
        got = await asyncio.wait_for(mailbox.get("next"), 10)
        assert torch.equal(got.tensors["x"], big * 3)
        for row, block in zip(got.block_ids, want, strict=True):
            assert torch.equal(table.storage[row].view(torch.float32), block)
        assert len(mailbox) == 1
    finally:
        await sender.close()
        await receiver.close()


async def test_ucx_a_receiver_that_cannot_post_its_receives_ends_the_hand_off() -> None:
    """A failure on the receiving side (here: no memory for the tensor) is a prompt
    ConnectionError at the sender, not a wait for a reply that never comes."""
    mailbox = Mailbox()
    receiver = make_receiver("ucx", mailbox)
    await receiver.start()

    def no_memory(spec: dict[str, object]) -> object:
        raise RuntimeError("out of memory")

    setattr(receiver, "_receive_buffer", no_memory)  # noqa: B010 (a private hook)
    sender = make_sender("ucx")
    try:
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(
                sender.send(receiver.address, Message("r", "s", {"x": torch.ones(1 << 18)})), 10
            )
    finally:
        await sender.close()
        await receiver.close()


async def test_ucx_a_message_that_cannot_be_built_is_refused_and_the_next_one_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error building a landed message (a device without room, say) refuses it with
    the reason; the receiver's poller keeps going and the connection stays usable."""
    from omnipipe.transfer import TransferRefused, ucx_landing

    real = ucx_landing.message_from
    failures = iter([RuntimeError("CUDA out of memory")])

    def flaky(*args: object, **kwargs: object) -> Message:
        for exc in failures:
            raise exc
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ucx_landing, "message_from", flaky)
    mailbox = Mailbox()
    receiver = make_receiver("ucx", mailbox)
    await receiver.start()
    sender = make_sender("ucx")
    x = torch.randn(1 << 18)
    try:
        with pytest.raises(TransferRefused, match="CUDA out of memory"):
            await asyncio.wait_for(sender.send(receiver.address, Message("a", "s", {"x": x})), 10)
        assert mailbox.bytes_held == 0
        await asyncio.wait_for(sender.send(receiver.address, Message("b", "s", {"x": x})), 10)
        got = await asyncio.wait_for(mailbox.get("b"), 10)
        assert torch.equal(got.tensors["x"], x)
    finally:
        await sender.close()
        await receiver.close()


def test_freed_rows_come_back_in_their_order() -> None:
    """A message's adjacent rows, freed, are handed out again as the same run."""
    from omnipipe.transfer import BlockTable

    table = BlockTable(num_blocks=8, block_bytes=4)
    first = table.allocate(5, 4)
    assert table.run(first) is not None
    table.free(first)
    again = table.allocate(5, 4)
    assert again == first
    assert table.run(again) is not None


@pytest.mark.parametrize("backend", BACKENDS)
async def test_kv_blocks_that_do_not_fit_are_refused_and_the_connection_stays_usable(
    backend: str,
) -> None:
    from omnipipe.transfer import BlockTable, TransferRefused

    table = BlockTable(num_blocks=4, block_bytes=1024)
    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox, block_table=table)
    await receiver.start()
    bare = make_receiver(backend, Mailbox())  # no block table at all
    await bare.start()
    sender = make_sender(backend)
    blocks = [torch.zeros(256) for _ in range(5)]
    try:
        with pytest.raises(TransferRefused, match="block table full"):
            await sender.send(receiver.address, Message("r", "s", {}, blocks=blocks))
        with pytest.raises(TransferRefused, match="1024"):
            await sender.send(receiver.address, Message("r", "s", {}, blocks=[torch.zeros(8)]))
        with pytest.raises(TransferRefused, match="no block table"):
            await sender.send(bare.address, Message("r", "s", {}, blocks=blocks[:1]))
        assert mailbox.bytes_held == 0
        assert table.free_blocks == 4
        await sender.send(receiver.address, Message("r", "s", {}, blocks=blocks[:4]))
        assert len((await asyncio.wait_for(mailbox.get("r"), 10)).block_ids) == 4
    finally:
        await sender.close()
        await bare.close()
        await receiver.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_kv_rows_of_messages_dropped_unread_go_back_to_the_table(backend: str) -> None:
    """A request cancelled or expired before its job took its KV blocks: discarding it
    frees the rows, and so does a late chunk for a request already over here."""
    from omnipipe.transfer import BlockTable

    table = BlockTable(num_blocks=8, block_bytes=1024)
    mailbox = Mailbox()
    receiver = make_receiver(backend, mailbox, block_table=table)
    await receiver.start()
    sender = make_sender(backend)
    blocks = [torch.zeros(256) for _ in range(3)]
    try:
        await sender.send(receiver.address, Message("gone", "s", {}, blocks=blocks))
        assert table.free_blocks == 5
        mailbox.discard("gone")
        assert table.free_blocks == 8
        await sender.send(receiver.address, Message("gone", "s", {}, blocks=blocks, chunk=1))
        assert table.free_blocks == 8
        assert mailbox.bytes_held == 0
    finally:
        await sender.close()
        await receiver.close()


async def test_ucx_receive_buffers_are_reused_once_their_tensors_are_gone() -> None:
    """Large tensors are received into pooled buffers: the next message of the same
    size lands in the memory the freed tensor had (no fresh pages to fault in)."""
    mailbox = Mailbox()
    receiver = make_receiver("ucx", mailbox)
    await receiver.start()
    sender = make_sender("ucx")
    x = torch.randn(1 << 20)  # 4 MiB
    try:
        await sender.send(receiver.address, Message("a", "s", {"x": x}))
        first = (await asyncio.wait_for(mailbox.get("a"), 10)).tensors["x"]
        assert torch.equal(first, x)
        address = first.data_ptr()
        del first
        await sender.send(receiver.address, Message("b", "s", {"x": x + 1}))
        second = (await asyncio.wait_for(mailbox.get("b"), 10)).tensors["x"]
        assert torch.equal(second, x + 1)
        assert second.data_ptr() == address
    finally:
        await sender.close()
        await receiver.close()


async def test_ucx_hand_offs_with_room_are_taken_without_a_task_each() -> None:
    """A hand-off whose request has room in the mailbox is admitted, received and
    acknowledged by the worker's pollers: small (inline) and large (tensors received
    straight into pooled buffers) alike, with no task started for it."""
    from omnipipe.transfer.ucx_receiver import UcxReceiver

    mailbox = Mailbox()
    receiver = make_receiver("ucx", mailbox)
    assert isinstance(receiver, UcxReceiver)
    await receiver.start()
    sender = make_sender("ucx")
    small, large = torch.randn(1024), torch.randn(1 << 18)  # 4 KiB inline, 1 MiB not
    try:
        await sender.send(receiver.address, Message("warm", "s", {"x": small}))
        started: list[asyncio.Task[None]] = []
        track = receiver._track
        receiver._track = lambda task: (started.append(task), track(task))[1]  # type: ignore[method-assign]
        for i in range(5):
            await sender.send(receiver.address, Message(f"m{i}", "s", {"a": small, "b": large}))
        assert started == []
        for i in range(5):
            got = await asyncio.wait_for(mailbox.get(f"m{i}"), 10)
            assert torch.equal(got.tensors["a"], small)
            assert torch.equal(got.tensors["b"], large)
    finally:
        await sender.close()
        await receiver.close()


async def test_ucx_a_receiver_polls_a_moment_after_a_hand_off_then_stops() -> None:
    """A stage's chunks come in bursts: after taking one, even a small inline one, the
    receiver polls its worker for SPIN_SECONDS (the next is seen without an event-fd
    wake-up), then stops (an idle worker burns no core)."""
    from omnipipe.transfer import ucx_worker
    from omnipipe.transfer.ucx_receiver import UcxReceiver

    mailbox = Mailbox()
    receiver = make_receiver("ucx", mailbox)
    assert isinstance(receiver, UcxReceiver)
    await receiver.start()
    sender = make_sender("ucx")
    try:
        await sender.send(receiver.address, Message("warm", "s", {"x": torch.zeros(8)}))
        await asyncio.sleep(ucx_worker.SPIN_SECONDS + 0.05)
        worker = receiver._ucx
        assert worker is not None
        assert not worker._spinning
        await sender.send(receiver.address, Message("r", "s", {"x": torch.zeros(8)}))
        assert worker._spinning
        await asyncio.sleep(ucx_worker.SPIN_SECONDS + 0.05)
        assert not worker._spinning
    finally:
        await sender.close()
        await receiver.close()


async def test_ucx_receivers_sharing_a_worker_each_take_their_own_messages() -> None:
    """Two receivers on one event loop share its UCX worker (each a poller of it);
    closing one leaves the other receiving."""
    from omnipipe.transfer import ucx_worker

    workers = ucx_worker.active_workers()
    first, second = Mailbox(), Mailbox()
    a, b = make_receiver("ucx", first), make_receiver("ucx", second)
    await a.start()
    await b.start()
    sender = make_sender("ucx")
    x = torch.randn(1 << 18)
    try:
        await sender.send(a.address, Message("to-a", "s", {"x": x}))
        await sender.send(b.address, Message("to-b", "s", {"x": x + 1}))
        assert torch.equal((await asyncio.wait_for(first.get("to-a"), 10)).tensors["x"], x)
        assert torch.equal((await asyncio.wait_for(second.get("to-b"), 10)).tensors["x"], x + 1)
        assert len(first) == 1  # nothing crossed over
        assert len(second) == 1
        await a.close()
        await sender.send(b.address, Message("again", "s", {"x": x + 2}))
        got = await asyncio.wait_for(second.get("again"), 10)
        assert torch.equal(got.tensors["x"], x + 2)
        assert ucx_worker.active_workers() == workers + 1  # one for the loop
    finally:
        await sender.close()
        await b.close()
        await a.close()
    assert ucx_worker.active_workers() == workers


_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BLOCKED_RECEIVER = """
import asyncio, sys
from omnipipe.transfer import Mailbox, make_receiver

async def main() -> None:
    receiver = make_receiver(sys.argv[1], Mailbox(per_request=1), credential="c")
    await receiver.start()
    print(receiver.address, flush=True)
    await asyncio.sleep(3600)  # never takes anything out: the second message waits

asyncio.run(main())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_receiver_that_dies_mid_transfer_is_a_clean_error(backend: str) -> None:
    """The sender waits on a receiver that holds its message (back-pressure); the
    receiver is killed (-9): the send raises a ConnectionError at once, no hang."""
    import subprocess
    import sys

    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", _BLOCKED_RECEIVER, backend),
        stdout=subprocess.PIPE,
        cwd=_REPO_ROOT,
    )
    sender = make_sender(backend, credential="c")
    try:
        assert proc.stdout is not None
        address = (await proc.stdout.readline()).decode().strip()
        payload = {"x": torch.randn(1 << 20)}
        await sender.send(address, Message("r", "s", payload))
        pending = asyncio.create_task(sender.send(address, Message("r", "s", payload)))
        await asyncio.sleep(1.0)
        assert not pending.done()  # held by back-pressure
        proc.kill()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(pending, 10)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        await sender.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_ucx_moves_cuda_tensors_device_to_device() -> None:
    """Where UCX has CUDA and a GPU is present, a CUDA tensor is sent from and received
    into device memory (no host bounce) and arrives on the device; a small one rides in
    the control message as host bytes and is put back on its device."""
    mailbox = Mailbox()
    receiver = make_receiver("ucx", mailbox)
    await receiver.start()
    sender = make_sender("ucx")
    x = torch.randn(1 << 20, device="cuda")
    small = torch.arange(100, device="cuda", dtype=torch.bfloat16).reshape(10, 10)
    try:
        await sender.send(receiver.address, Message("gpu", "s", {"x": x, "small": small}))
        got = (await asyncio.wait_for(mailbox.get("gpu"), 30)).tensors
        assert got["x"].is_cuda
        assert torch.equal(got["x"], x)
        assert got["small"].is_cuda
        assert torch.equal(got["small"], small)
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_ucx_sends_a_cuda_tensor_only_once_the_work_writing_it_is_done() -> None:
    """UCX copies device memory on its own streams: a tensor sent straight after the
    kernel that writes it (still queued) arrives with that kernel's result."""
    mailbox = Mailbox()
    receiver = make_receiver("ucx", mailbox)
    await receiver.start()
    sender = make_sender("ucx")
    a = torch.randn(4096, 4096, device="cuda")
    try:
        for i in range(5):
            x = (a @ a + i).reshape(-1)  # queued, not finished, when send() is called
            await sender.send(receiver.address, Message(f"gpu{i}", "s", {"x": x}))
            got = (await asyncio.wait_for(mailbox.get(f"gpu{i}"), 30)).tensors["x"]
            assert got.is_cuda
            assert torch.equal(got, x)
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_ucx_refuses_cuda_tensors_cleanly_and_the_connection_stays_usable() -> None:
    """A refused device-memory message is received into nothing (no data moves); the
    next message on the same connection arrives whole."""
    from omnipipe.transfer import TransferRefused

    mailbox = Mailbox(max_bytes=8 << 20)
    receiver = make_receiver("ucx", mailbox)
    await receiver.start()
    sender = make_sender("ucx")
    big = torch.ones(16 << 20, dtype=torch.uint8, device="cuda")
    small = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(TransferRefused, match="mailbox full"):
            await sender.send(receiver.address, Message("big", "s", {"x": big}))
        assert mailbox.bytes_held == 0
        await sender.send(receiver.address, Message("small", "s", {"x": small}))
        got = (await asyncio.wait_for(mailbox.get("small"), 30)).tensors["x"]
        assert got.is_cuda
        assert torch.equal(got, small)
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_ucx_moves_kv_blocks_from_device_memory_into_the_block_table() -> None:
    """KV blocks in a CUDA paged cache are gathered on the device and land in the
    receiver's (host) block table: adjacent rows, then scattered ones."""
    from omnipipe.transfer import BlockTable

    table = BlockTable(num_blocks=32, block_bytes=4096)
    mailbox = Mailbox()
    receiver = make_receiver("ucx", mailbox, block_table=table)
    await receiver.start()
    sender = make_sender("ucx")
    cache = torch.randn(64, 1024, device="cuda")
    picked = [int(i) for i in torch.randperm(64)[:8]]
    try:
        for i in range(2):
            await sender.send(
                receiver.address, Message(f"kv{i}", "s", {}, blocks=[cache[j] for j in picked])
            )
            got = await asyncio.wait_for(mailbox.get(f"kv{i}"), 30)
            for row, j in zip(got.block_ids, picked, strict=True):
                assert torch.equal(table.storage[row].view(torch.float32), cache[j].cpu())
            if i == 0:  # scatter the free rows for the second message
                held = table.allocate(table.free_blocks, 4096)
                table.free(held[1::2])
    finally:
        await sender.close()
        await receiver.close()


def test_ucx_pool_buffers_start_on_a_huge_page() -> None:
    """Large receive buffers start on a 2 MiB boundary (CMA copies into misaligned ones
    at a third of the speed), reused ones too."""
    from omnipipe.transfer.ucx_worker import HUGE_PAGE, BufferPool

    pool = BufferPool()
    first = pool.take(3 << 20)
    assert first.ctypes.data % HUGE_PAGE == 0
    assert first.nbytes == 3 << 20
    del first
    again = pool.take(3 << 20)
    assert again.ctypes.data % HUGE_PAGE == 0
    assert pool.held_bytes == 0  # it was the pooled one
