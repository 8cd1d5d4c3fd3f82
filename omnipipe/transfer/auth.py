"""Mutual proof of the pipeline credential, at the start of every transfer connection.

Both ends prove they hold the credential without sending it (HMAC-SHA256 over two fresh
nonces, compared with hmac.compare_digest):

    receiver -> sender   MAGIC, receiver nonce (32 bytes)
    sender   -> receiver sender nonce (32), HMAC(key, "sender" | nonces)
    receiver -> sender   ACCEPTED, HMAC(key, "receiver" | nonces)   or REFUSED, then close

The receiver reads no frame before the sender's proof checks out, so nothing an
unauthenticated peer sends is kept. The sender sends no tensor before the receiver's proof
checks out, so a worker never hands tensors to an address that is not a peer of its own
pipeline, whatever address a submission names.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

# The same name as omnipipe.api.constants.CREDENTIAL_ENV (a unit test keeps them equal):
# transfer/ imports nothing else of ours.
CREDENTIAL_ENV = "OMNIPIPE_PIPELINE_CREDENTIAL"
MAGIC = b"OMPT\x01"
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
ACCEPTED = b"\x06"
REFUSED = b"\x15"
# A peer that connects and then says nothing holds a connection this long at most.
HANDSHAKE_TIMEOUT_SECONDS = 10.0

Read = Callable[[int], Awaitable[bytes]]
Write = Callable[[bytes], Awaitable[None]]


class TransferRefused(ConnectionError):
    """The peer refused this connection or message, or could not prove the credential."""


def resolve_credential(credential: str | None) -> str | None:
    """The credential given, else the one in the environment (what the operator and
    `omnipipe serve` set), else None: unauthenticated, which only peers without a
    credential accept."""
    if credential is None:
        credential = os.environ.get(CREDENTIAL_ENV) or None
    return credential


def credential_key(credential: str | None) -> bytes:
    return (credential or "").encode()


def _proof(key: bytes, role: bytes, receiver_nonce: bytes, sender_nonce: bytes) -> bytes:
    return hmac.new(key, role + receiver_nonce + sender_nonce, hashlib.sha256).digest()


async def accept_peer(read: Read, write: Write, key: bytes) -> bool:
    """Receiver side. True when the sender proved the credential (and has our proof);
    False when it did not (it was told REFUSED): close the connection."""
    receiver_nonce = secrets.token_bytes(NONCE_BYTES)
    await write(MAGIC + receiver_nonce)
    answer = await read(NONCE_BYTES + PROOF_BYTES)
    sender_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(_proof(key, b"sender", receiver_nonce, sender_nonce), proof):
        await write(REFUSED)
        return False
    await write(ACCEPTED + _proof(key, b"receiver", receiver_nonce, sender_nonce))
    return True


async def prove_peer(read: Read, write: Write, key: bytes, address: str) -> None:
    """Sender side: raises TransferRefused unless both ends hold the same credential."""
    hello = await read(len(MAGIC) + NONCE_BYTES)
    if hello[: len(MAGIC)] != MAGIC:
        raise TransferRefused(f"{address} is not an omnipipe transfer listener")
    receiver_nonce = hello[len(MAGIC) :]
    sender_nonce = secrets.token_bytes(NONCE_BYTES)
    await write(sender_nonce + _proof(key, b"sender", receiver_nonce, sender_nonce))
    verdict = await read(1)
    if verdict != ACCEPTED:
        raise TransferRefused(f"{address} refused the pipeline credential")
    proof = await read(PROOF_BYTES)
    if not hmac.compare_digest(_proof(key, b"receiver", receiver_nonce, sender_nonce), proof):
        raise TransferRefused(
            f"{address} could not prove the pipeline credential: not a peer of this pipeline"
        )


def warn_if_open(credential: str | None, what: str) -> None:
    if not credential:
        log.warning(
            "%s runs without a pipeline credential (%s unset): any process that reaches it "
            "without one is accepted",
            what,
            CREDENTIAL_ENV,
        )
