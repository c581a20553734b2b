"""Hostile image files, round three: a decode has a work budget, memory stays in proportion to the
image, an I/O error is one line and never lost work."""
from __future__ import annotations

import io
import os
import time
import tracemalloc

import numpy as np
import pytest
from PIL import Image

from pipeline.core.errors import DataError
from pipeline.data import imagefolder
from pipeline.data.imagefolder import decode


def _progressive_jpeg(extra_scans: int = 0) -> bytes:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(
        buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    last = data.rindex(b"\xff\xda")  # the last scan, header and data, up to EOI
    return data[:-2] + data[last:-2] * extra_scans + data[-2:]


@pytest.mark.timeout(60)
def test_a_jpeg_of_too_many_scans_is_refused_before_it_is_decoded(tmp_path):
    good = tmp_path / "good.jpg"
    good.write_bytes(_progressive_jpeg())
    assert 1 < imagefolder.jpeg_scans(good.read_bytes()) <= imagefolder.MAX_JPEG_SCANS
    f = imagefolder.listed(str(good), 0)
    assert imagefolder.scan_file(f).error is None
    assert imagefolder.decode_file(f, 16).shape == (3, 16, 16)

    bad = tmp_path / "scans.jpg"
    bad.write_bytes(_progressive_jpeg(extra_scans=100_000))  # ~1 MB
    f = imagefolder.listed(str(bad), 0)
    start = time.monotonic()
    scans = imagefolder.jpeg_scans(bad.read_bytes())
    assert scans > 100_000
    assert imagefolder.scan_file(f).error == (
        f"{bad}: a JPEG of {scans} scans, more than the 256 a progressive JPEG needs (refused: "
        "each scan is another pass over the whole image)")
    with pytest.raises(DataError, match="scans, more than the 256 a progressive JPEG needs"):
        imagefolder.decode_file(f, 16)
    assert time.monotonic() - start < 5


@pytest.mark.timeout(120)
def test_a_16_bit_png_costs_a_few_bytes_a_pixel(tmp_path):
    """A 4096 x 4096 16-bit PNG (32 KB): what NumPy holds while it is converted stays under
    6 bytes a pixel (it was 24: a whole-image int64 temporary, and a read that reserved the
    256 MiB file cap)."""
    path = tmp_path / "deep.png"
    Image.fromarray(np.full((4096, 4096), 65535, np.uint16)).save(path)
    assert path.stat().st_size < 100_000
    f = imagefolder.listed(str(path), 0)
    tracemalloc.start()
    try:
        image = imagefolder.decode_file(f, 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (image == 255).all()
    assert peak < 6 * 4096 * 4096, peak / 4096 / 4096


def test_an_io_error_reading_an_image_is_one_line_and_not_lost_work(tmp_path):
    """EIO (a failing disk, NFS; here /proc/self/mem through a link, which reads as EIO)."""
    from pipeline.training import recovery
    link = tmp_path / "eio.jpg"
    os.symlink("/proc/self/mem", link)
    f = imagefolder.listed(str(link), 0)
    assert imagefolder.scan_file(f).error == f"{link}: cannot read the file (Input/output error)"
    with pytest.raises(DataError) as err:
        imagefolder.decode_chunk(imagefolder.DecodeChunk((f,), 8))
    assert str(err.value) == f"{link}: cannot read the file (Input/output error)"
    decision = recovery.decide(err.value, recovery.ClusterState(True), 0, where="", stopped_in=0)
    assert isinstance(decision, recovery.GiveUp) and decision.error is err.value  # not replayed


def test_out_of_memory_while_decoding_names_the_options(tmp_path, monkeypatch):
    path = tmp_path / "a.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(path)
    f = imagefolder.listed(str(path), 0)

    def no_memory(*args, **kwargs):
        raise MemoryError()
    monkeypatch.setattr(decode, "decode_file", no_memory)  # where decode_chunk finds it
    with pytest.raises(DataError, match=rf"out of memory decoding 1 images at 16x16 \(at "
                                        rf".*a.png\): lower --image-size, data.decode_chunk or "
                                        r"data.max_pixels"):
        imagefolder.decode_chunk(imagefolder.DecodeChunk((f,), 16))
