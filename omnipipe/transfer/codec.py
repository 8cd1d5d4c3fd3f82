"""Tensors <-> (header, buffers). dtype, shape and device travel as metadata; bfloat16
and every other torch dtype go as raw bytes reinterpreted on arrival."""

from __future__ import annotations

from typing import Any

import msgpack
import torch

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
    )
}
MAX_HEADER = 1 << 20


class CodecError(ValueError):
    """A frame that does not describe tensors we can rebuild."""


def tensor_spec(name: str, t: torch.Tensor) -> dict[str, Any]:
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise CodecError(f"tensor {name!r}: unsupported dtype {t.dtype}")
    return {
        "name": name,
        "dtype": dtype,
        "shape": list(t.shape),
        "device": str(t.device),
        "nbytes": t.numel() * t.element_size(),
    }


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (a GPU tensor is copied once)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def encode_header(header: dict[str, Any]) -> bytes:
    raw: bytes = msgpack.packb(header, use_bin_type=True)
    if len(raw) > MAX_HEADER:
        raise CodecError(f"header of {len(raw)} bytes exceeds {MAX_HEADER}")
    return raw


def _is_message(header: object) -> bool:
    return isinstance(header, dict) and isinstance(header.get("tensors"), list)


def decode_header(raw: bytes) -> dict[str, Any]:
    header = msgpack.unpackb(raw, raw=False)
    if not _is_message(header):
        raise CodecError("frame header is not a tensor message")
    assert isinstance(header, dict)
    return header


def decode_frame_header(raw: bytes) -> dict[str, Any]:
    """One message's header, or a batch's: {"batch": [message header, ...]}. A batch
    header has no `tensors`, so a receiver that predates batches (decode_header) rejects
    it and closes the connection before it queues anything."""
    header = msgpack.unpackb(raw, raw=False)
    if isinstance(header, dict) and "batch" in header:
        subs = header["batch"]
        if not isinstance(subs, list) or not subs or not all(_is_message(s) for s in subs):
            raise CodecError("batch header without its message headers")
        return header
    if not _is_message(header):
        raise CodecError("frame header is not a tensor message")
    assert isinstance(header, dict)
    return header


def rebuild(spec: dict[str, Any], buf: Any, device: str = "cpu") -> torch.Tensor:
    try:
        dtype = DTYPES[spec["dtype"]]
        shape = [int(s) for s in spec["shape"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise CodecError(f"bad tensor spec {spec!r}") from exc
    if len(buf) != int(spec["nbytes"]):
        raise CodecError(
            f"tensor {spec.get('name')!r}: got {len(buf)} bytes, want {spec['nbytes']}"
        )
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    if isinstance(buf, torch.Tensor):  # received straight into device memory
        return buf.view(dtype).reshape(shape)
    t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
    return t if device == "cpu" else t.to(device)
