"""A progressive JPEG is decoded once a scan: one of many small scans, within every pixel
limit, took 144 s. The scans are counted at the header and a file past the limit is
refused before any is decoded; the JPEGs encoders write pass."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
from PIL import Image

from omnipipe.api.stage_spec import MediaLimits
from omnipipe.stagekit.media import MAX_JPEG_SCANS, MediaBudget, charge_image, decode_image
from omnipipe.stagekit.stage import StageInputError


def jpeg(size: int, progressive: bool) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90, progressive=progressive)
    return out.getvalue()


def split_scans(data: bytes) -> tuple[bytes, list[bytes]]:
    """The bytes before the first scan, and each scan with the table segments written just
    before it (its SOS segment and entropy-coded data), walking the markers as a decoder
    does."""
    i = 2  # SOI
    while data[i + 1] != 0xDA:
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    head, scans, start = data[:i], [], i
    while data[i + 1] != 0xD9:  # EOI
        marker = data[i + 1]
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xDA:
            # Entropy-coded data ends at the first marker that is not stuffing or a restart.
            while not (data[i] == 0xFF and data[i + 1] not in (0x00, *range(0xD0, 0xD8))):
                i += 1
            scans.append(data[start:i])
            start = i
    return head, scans


def many_scans(size: int, copies: int) -> bytes:
    """A progressive JPEG whose AC scans come again `copies` times: libjpeg takes the
    repeats with a warning (a bogus progression) and decodes every one."""
    head, scans = split_scans(jpeg(size, progressive=True))
    return head + scans[0] + b"".join(scans[1:]) * copies + b"\xff\xd9"


@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_the_jpegs_encoders_write_decode(progressive: bool) -> None:
    data = jpeg(256, progressive)
    assert 1 <= len(split_scans(data)[1]) <= 12
    assert decode_image(base64.b64encode(data).decode(), "x").size == (256, 256)


def test_a_jpeg_of_many_scans_is_refused_at_its_header() -> None:
    data = many_scans(512, copies=200)
    assert len(split_scans(data)[1]) > 10 * MAX_JPEG_SCANS
    sent = base64.b64encode(data).decode()
    for check in (
        lambda: decode_image(sent, "messages[0].content[1]"),
        lambda: charge_image(sent, "messages[0].content[1]", MediaBudget(MediaLimits())),
    ):
        # This thread's CPU time: the header's parse is the whole of the work, however
        # loaded the machine is (its wall time is not: a busy CI machine stretched it).
        started = time.thread_time()
        with pytest.raises(StageInputError, match=f"past the limit of {MAX_JPEG_SCANS}"):
            check()
        assert time.thread_time() - started < 1.0


def test_what_the_limit_saves() -> None:
    """The work the limit refuses grows with the scans: libjpeg decodes a file of ten
    times the scans in several times the time of the file an encoder wrote."""
    written = jpeg(512, progressive=True)
    repeated = many_scans(512, copies=10)

    def decode_seconds(data: bytes) -> float:  # CPU seconds, as load cannot stretch them
        started = time.thread_time()
        with Image.open(io.BytesIO(data)) as image:
            image.convert("RGB")
        return time.thread_time() - started

    plain = min(decode_seconds(written) for _ in range(3))
    costly = min(decode_seconds(repeated) for _ in range(3))
    assert costly > 3 * plain, (plain, costly)
