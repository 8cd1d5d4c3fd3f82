"""The check behind the local hand-off's contract (transfer/local.py): a stage writes
neither into a tensor it handed off by reference nor into one it received.

Torch has no read-only tensors, but every in-place write bumps a tensor's `_version`,
which the sender's tensor and the receiver's share (detach() and views keep the
counter). Tests run with OMNIPIPE_TRANSFER_CHECK_ALIASING=1 and call check()."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

CHECK_ALIASING_ENV = "OMNIPIPE_TRANSFER_CHECK_ALIASING"
# Records are pruned of hand-offs nobody holds any more every this many.
_PRUNE_EVERY = 1024


class AliasingError(RuntimeError):
    """A tensor handed off by reference was written in place after its delivery."""


@dataclass(frozen=True)
class _Delivered:
    source: str
    address: str
    request_id: str
    key: str
    version: int
    # Weak: the check must not keep a hand-off alive. A write matters while either side
    # still holds its tensor; once both let go, nobody can read the damage.
    refs: tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]

    def live(self) -> torch.Tensor | None:
        for ref in self.refs:
            tensor = ref()
            if tensor is not None:
                return tensor
        return None


class AliasingCheck:
    """The tensors delivered by reference, each with its version at delivery."""

    def __init__(self) -> None:
        self._delivered: list[_Delivered] = []

    def record(
        self,
        source: str,
        address: str,
        request_id: str,
        key: str,
        sent: torch.Tensor,
        received: torch.Tensor,
    ) -> None:
        """`received` (at `address`, under `key`) shares `sent`'s memory."""
        refs = (weakref.ref(sent), weakref.ref(received))
        self._delivered.append(
            _Delivered(source, address, request_id, key, received._version, refs)
        )
        if len(self._delivered) % _PRUNE_EVERY == 0:
            self._prune()

    def _prune(self) -> None:
        self._delivered = [d for d in self._delivered if d.live() is not None]

    def check(self) -> None:
        """Raises AliasingError naming each tensor written in place since its delivery,
        by the stage that sent it or by the one that received it."""
        self._prune()
        written = []
        for d in self._delivered:
            tensor = d.live()
            if tensor is not None and tensor._version != d.version:
                written.append(
                    f"{d.key!r} of request {d.request_id} from stage {d.source} to "
                    f"{d.address} (version {d.version} -> {tensor._version})"
                )
        if written:
            raise AliasingError(
                "tensors handed off by reference were written in place after delivery: "
                + "; ".join(written)
            )
