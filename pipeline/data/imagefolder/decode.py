"""Reading one image file: its header checked (formats, pixel cap, JPEG scans), every byte of it
scanned (``scan-`` tasks), or decoded to a square uint8 RGB array (``decode-`` tasks)."""
from __future__ import annotations

import io
import math
import struct

import numpy as np

from pipeline.core.errors import DataError
from pipeline.core.files import os_reason, read_capped
from pipeline.data.imagefolder.layout import (FORMATS, MAX_FILE_BYTES, MAX_JPEG_SCANS,
                                              MAX_PIXELS, DecodeChunk, FileInfo, ImageFile)

_ORIENTATION = 0x0112  # the EXIF tag


def _open(path: str, data: bytes, max_pixels: int):
    """Pillow image of ``data`` (header only read), pixel count checked."""
    from PIL import Image, UnidentifiedImageError
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise DataError(f"{path}: not an image Pillow can read as {'/'.join(FORMATS)}") from None
    except Image.DecompressionBombError as exc:
        raise DataError(f"{path}: refused as a decompression bomb ({os_reason(exc)})") from None
    except (OSError, ValueError, SyntaxError, struct.error) as exc:
        raise DataError(f"{path}: corrupt or truncated image header ({os_reason(exc)})") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise DataError(f"{path}: empty image ({width}x{height})")
    if image.format == "JPEG" and (scans := jpeg_scans(data)) > MAX_JPEG_SCANS:
        raise DataError(f"{path}: a JPEG of {scans} scans, more than the {MAX_JPEG_SCANS} a "
                        "progressive JPEG needs (refused: each scan is another pass over the "
                        "whole image)")
    if width * height > max_pixels:
        raise DataError(f"{path}: {width}x{height} = {width * height} pixels, more than the cap "
                        f"of {max_pixels} (data.max_pixels)")
    return image


def jpeg_scans(data: bytes) -> int:
    """Start-of-scan markers in a JPEG stream: the header segments are skipped by their lengths
    up to the first scan; after it, 0xFF 0xDA can only be a marker (entropy-coded data stuffs
    every 0xFF with 0x00), so the rest is counted at C speed. An upper bound where a table
    between scans happens to hold those two bytes; a linear pass, never a decode.

    >>> jpeg_scans(b"\\xff\\xd8\\xff\\xe0\\x00\\x04\\xff\\xda\\xff\\xda\\x00\\x02..\\xff\\xda\\x00\\x02\\xff\\xd9")
    2
    """
    pos = 2  # after SOI
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
        elif marker == 0xDA:
            return 1 + data.count(b"\xff\xda", pos + 2)
        elif 0xD0 <= marker <= 0xD8 or marker == 0x01:  # no length
            pos += 2
        else:
            pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    return 0


def _load(path: str, image) -> None:
    """Decode the pixels (after any draft); a truncated or corrupt stream is a DataError."""
    from PIL import Image
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise DataError(f"{path}: refused as a decompression bomb ({os_reason(exc)})") from None
    except (OSError, ValueError, SyntaxError, IndexError, struct.error, EOFError,
            ZeroDivisionError) as exc:
        raise DataError(f"{path}: corrupt or truncated image ({os_reason(exc)})") from None


def to_rgb(image):
    """Any Pillow mode -> an RGB image (see the module docstring for what each mode becomes)."""
    from PIL import Image
    if image.mode == "RGB":
        return image
    if image.mode.startswith("I"):  # 16-bit grayscale (I;16, I;16B, I from PNG): 0..65535
        image = Image.fromarray(_scale_16_bit(np.asarray(image)), "L")
    elif image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    elif image.mode == "La":
        image = image.convert("LA")
    return image.convert("RGB")


def _scale_16_bit(values: np.ndarray, rows: int = 1 << 20) -> np.ndarray:
    """(H, W) 16- or 32-bit grayscale -> (H, W) uint8, 0..65535 scaled to 0..255 (rounded),
    in blocks of about ``rows`` pixels: a whole-image int64 temporary cost 8 bytes a pixel more
    (a 130 KB 16-bit PNG of 67 M pixels took 1.8 GB), this costs the uint8 result.

    >>> _scale_16_bit(np.array([[0, 129, 65535, 70000]], np.int32)).tolist()
    [[0, 1, 255, 255]]
    """
    out = np.empty(values.shape, np.uint8)
    step = max(1, rows // max(1, values.shape[1]))
    for top in range(0, values.shape[0], step):
        block = values[top:top + step].astype(np.int64)
        out[top:top + step] = np.clip((block + 128) // 257, 0, 255)
    return out


def scan_file(f: ImageFile, max_pixels: int = MAX_PIXELS) -> FileInfo:
    """Check one file the way decoding will read it: header, pixel cap, and every byte of the
    compressed stream (JPEGs decoded at 1/8 scale, which still reads all of it)."""
    try:
        data = read_capped(f.path, MAX_FILE_BYTES, "an image file")
        image = _open(f.path, data, max_pixels)
        info = (image.size[0], image.size[1], image.format or "?", image.mode)
        if image.format == "JPEG":
            image.draft(None, (1, 1))  # smallest DCT scale: fast, still the whole stream
        _load(f.path, image)
        return FileInfo(*info)
    except DataError as err:
        return FileInfo(0, 0, "", "", str(err))


def scan_files(files: tuple, max_pixels: int = MAX_PIXELS) -> tuple:
    """The ``scan-`` task: one :class:`FileInfo` per file, problems as values (never raises)."""
    return tuple(scan_file(f, max_pixels) for f in files)


def _box(width: int, height: int) -> tuple:
    """The centred square of the image, as a float box."""
    side = min(width, height)
    x0, y0 = (width - side) / 2, (height - side) / 2
    return (x0, y0, x0 + side, y0 + side)


def decode_file(f: ImageFile, size: int, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """One image -> (3, size, size) uint8: the centred square, resized (antialiased bilinear) to
    ``size``. JPEGs are decoded at the smallest DCT scale that keeps at least ``size`` pixels
    across the square (libjpeg's draft mode), several times cheaper than a full decode for
    photos much larger than ``size`` (benchmarks/decode.py)."""
    from PIL import Image
    data = read_capped(f.path, MAX_FILE_BYTES, "an image file")
    image = _open(f.path, data, max_pixels)
    orientation = _orientation(image)
    width, height = image.size
    if image.format == "JPEG":
        scale = size / min(width, height)
        image.draft("RGB" if image.mode == "RGB" else None,
                    (math.ceil(width * scale), math.ceil(height * scale)))
    _load(f.path, image)
    try:
        image = to_rgb(image)
        image = image.resize((size, size), Image.BILINEAR, box=_box(*image.size),
                             reducing_gap=3.0)
    except (OSError, ValueError) as exc:
        raise DataError(f"{f.path}: cannot convert {image.mode} to RGB "
                        f"({os_reason(exc)})") from None
    if orientation in _TRANSPOSES:
        image = image.transpose(_TRANSPOSES[orientation])
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def _orientation(image) -> int:
    try:
        return int(image.getexif().get(_ORIENTATION, 1))
    except Exception:  # a damaged EXIF block: keep the image as stored
        return 1


def _transposes() -> dict:
    from PIL import Image
    T = Image.Transpose
    return {2: T.FLIP_LEFT_RIGHT, 3: T.ROTATE_180, 4: T.FLIP_TOP_BOTTOM, 5: T.TRANSPOSE,
            6: T.ROTATE_270, 7: T.TRANSVERSE, 8: T.ROTATE_90}


_TRANSPOSES = _transposes()


def decode_chunk(chunk: DecodeChunk) -> tuple[np.ndarray, np.ndarray]:
    """The ``decode-`` task: ``(n, 3, size, size) uint8`` images and ``(n,) int32`` labels.

    With ``crop < 1`` (evaluation) each image is decoded at ``size / crop`` and its centre kept
    (`augment.center_crop`): torchvision's Resize + CenterCrop, one resampling.
    """
    import augment
    outer, i = max(chunk.size, int(round(chunk.size / chunk.crop))), 0
    try:
        images = np.empty((chunk.n, 3, outer, outer), np.uint8)
        for i, f in enumerate(chunk.files):
            images[i] = decode_file(f, outer, chunk.max_pixels)
    except MemoryError:  # one line naming what sizes it, not a worker traceback
        raise DataError(f"out of memory decoding {chunk.n} images at {outer}x{outer} (at "
                        f"{chunk.files[min(i, chunk.n - 1)].path if chunk.n else '-'}): lower "
                        "--image-size, data.decode_chunk or data.max_pixels") from None
    if outer != chunk.size:
        images = np.ascontiguousarray(augment.center_crop(images, chunk.size))
    return images, np.array([f.label for f in chunk.files], np.int32).reshape(-1)
