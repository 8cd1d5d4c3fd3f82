"""One message as a frame header (msgpack) and its buffers, and back: what every backend
sends and receives."""

from __future__ import annotations

from typing import Any

import torch

from omnipipe.transfer.codec import CodecError, rebuild, tensor_bytes, tensor_spec
from omnipipe.transfer.message import Message


def frame_header(
    message: Message, device_direct: bool = False, direct_min: int = 0
) -> tuple[dict[str, object], list[Any]]:
    """The header and each tensor's bytes (a memoryview of host memory). With
    `device_direct`, a CUDA tensor of at least `direct_min` bytes has the tensor itself
    as its buffer (flat uint8, still on the device) and its spec says "direct"."""
    specs: list[dict[str, Any]] = []
    buffers: list[Any] = []
    for name, tensor in message.tensors.items():
        spec = tensor_spec(name, tensor)
        if device_direct and tensor.is_cuda and spec["nbytes"] >= direct_min:
            spec["direct"] = True
            buffers.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        else:
            buffers.append(tensor_bytes(tensor))
        specs.append(spec)
    header = {
        "request_id": message.request_id,
        "source": message.source,
        "chunk": message.chunk,
        "final": message.final,
        "meta": message.meta,
        "tensors": specs,
    }
    if message.blocks:
        sizes = {b.numel() * b.element_size() for b in message.blocks}
        if len(sizes) != 1:
            raise CodecError(f"KV blocks of different sizes: {sorted(sizes)}")
        header["blocks"] = {"count": len(message.blocks), "nbytes": sizes.pop()}
    return header, buffers


def block_buffers(message: Message) -> list[memoryview]:
    """Each KV block's bytes, from its own memory (blocks need not be adjacent)."""
    return [tensor_bytes(b) for b in message.blocks]


def block_bytes(header: dict[str, Any]) -> int:
    blocks = header.get("blocks") or {}
    try:
        count, nbytes = int(blocks.get("count", 0)), int(blocks.get("nbytes", 0))
    except (AttributeError, TypeError, ValueError) as exc:
        raise CodecError(f"bad block spec {blocks!r}") from exc
    if count < 0 or nbytes < 0:
        raise CodecError(f"bad block spec {blocks!r}")
    return count * nbytes


def message_from(
    header: dict[str, object],
    buffers: list[Any],
    block_ids: list[int] | None = None,
    blocks: list[torch.Tensor] | None = None,
    to_device: bool = False,
) -> Message:
    """`to_device`: a CUDA tensor that travelled as host bytes goes back to its device."""
    specs = header["tensors"]
    assert isinstance(specs, list)
    tensors = {
        s["name"]: rebuild(s, b, _home(s) if to_device else "cpu")
        for s, b in zip(specs, buffers, strict=True)
    }
    meta = header.get("meta") or {}
    return Message(
        blocks=blocks or [],
        block_ids=block_ids or [],
        request_id=str(header["request_id"]),
        source=str(header["source"]),
        tensors=tensors,
        chunk=int(header.get("chunk", 0)),  # type: ignore[call-overload]
        final=bool(header.get("final", True)),
        meta=dict(meta),  # type: ignore[call-overload]
    )


def _home(spec: dict[str, Any]) -> str:
    device = str(spec.get("device", "cpu"))
    return device if device.startswith("cuda") else "cpu"


def declared_bytes(header: dict[str, Any]) -> int:
    """What a frame's tensors will take, from its header, before any is read."""
    total = 0
    for spec in header["tensors"]:
        try:
            nbytes = int(spec["nbytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CodecError(f"bad tensor spec {spec!r}") from exc
        if nbytes < 0:
            raise CodecError(f"bad tensor spec {spec!r}")
        total += nbytes
    return total
