"""The values of image folders and file lists: limits, the formats and extensions read, an image
as listed, a split's listing, a scan's finding, a ``decode-`` task's input; an ImageFile from a
path, a listing's stratified val split and its fingerprint."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
from typing import NamedTuple

import numpy as np

from pipeline.core.errors import DataError
from pipeline.core.files import describe, os_reason

# Formats Pillow may open (its plugin names). EPS/PS (Ghostscript), PDF and other exotic plugins
# are never tried, so a file named .jpg cannot reach them.
FORMATS = ("JPEG", "PNG", "BMP", "GIF", "TIFF", "WEBP", "PPM")
# Extensions an image file may have; other files inside a class folder are skipped (and counted).
EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm",
              ".pbm", ".pnm")
LIST_EXTENSIONS = (".txt", ".lst", ".list", ".tsv")  # a --data file with one of these is a file list
MAX_FILE_BYTES = 1 << 28  # 256 MiB: larger image files are refused before they are read
MAX_LIST_BYTES = 1 << 28  # a file list of ~5 M lines at most
MAX_PIXELS = 1 << 26  # default cap on width x height (67 M pixels, e.g. 8192 x 8192)
# Scans of a progressive JPEG decoded at most: encoders write ~10 (mozjpeg 9-12); each scan is a
# pass over the whole coefficient buffer, so 100,000 empty scans in 1 MB took ~8 minutes to decode.
MAX_JPEG_SCANS = 256
EVAL_CROP = 0.875  # fraction of the centred square kept for evaluation (torchvision's 224 / 256)

# The file that marks a run directory of ours (pipeline.outputs.fs.MARKER): an --out inside the
# image folder is never read as a class or as images.
RUN_MARKER = ".dask-chainer-run"


class ImageFile(NamedTuple):
    """One image as listed: enough for any worker that sees the same path to read it."""
    path: str
    label: int
    bytes: int  # file size when listed
    mtime_ns: int  # modification time when listed


class Listing(NamedTuple):
    """The files of one split and the class names, before any file was opened."""
    files: tuple  # ImageFile, in a fixed order (class, then path)
    class_names: tuple  # class index -> name
    where: str  # the folder or list it came from (for messages)
    skipped: tuple = ()  # (kind, count) of what a folder held besides images, most first:
    #                      kinds are extensions (".txt"), "no extension", "hidden file",
    #                      "hidden folder"


class FileInfo(NamedTuple):
    """What a scan found about one file: its header, or the one-line problem."""
    width: int
    height: int
    format: str
    mode: str
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class DecodeChunk:
    """The input of one ``decode-`` task: files, and how to decode them."""
    files: tuple  # ImageFile
    size: int  # side of the square output (pixels)
    crop: float = 1.0  # share of the centred square's side kept (1: all; EVAL_CROP for val)
    max_pixels: int = MAX_PIXELS

    @property
    def n(self) -> int:
        return len(self.files)


def listed(path: str, label: int) -> ImageFile:
    """An ImageFile for ``path``; DataError unless it is a regular file (symlinks followed)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DataError(f"{path}: {os_reason(exc)}") from None
    except ValueError:  # a NUL byte
        raise DataError(f"{path!r}: a NUL byte in the path; no file name holds one") from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{path}: is {describe(st.st_mode)}, expected a regular file")
    return ImageFile(path, label, st.st_size, st.st_mtime_ns)

def split_listing(listing: Listing, fraction: float, rng: np.random.Generator
                  ) -> tuple[Listing, Listing]:
    """A stratified random split: per class, ``round(fraction * n)`` images (at least one when the
    class has two or more) go to the val split. The order inside each split stays the listing's.

    >>> files = tuple(ImageFile(f"{c}/{i}.jpg", c, 1, 0) for c in range(2) for i in range(10))
    >>> train, val = split_listing(Listing(files, ("a", "b"), "x"), 0.2, np.random.default_rng(0))
    >>> len(train.files), len(val.files), sorted(f.label for f in val.files)
    (16, 4, [0, 0, 1, 1])
    """
    labels = np.array([f.label for f in listing.files])
    to_val = np.zeros(len(labels), bool)
    for label in range(len(listing.class_names)):
        members = np.flatnonzero(labels == label)
        k = int(round(fraction * len(members)))
        k = min(max(k, 1 if len(members) > 1 else 0), len(members) - 1)
        to_val[rng.permutation(members)[:k]] = True
    if not to_val.any():
        raise DataError(f"{listing.where}: too few images for a val split of {fraction:g}")
    pick = lambda mask: tuple(f for f, m in zip(listing.files, mask) if m)  # noqa: E731
    return (listing._replace(files=pick(~to_val)), listing._replace(files=pick(to_val)))


def fingerprint(files) -> str:
    """A hash of paths, labels, sizes and mtimes: same fingerprint, same data."""
    digest = hashlib.sha1()
    for f in files:  # a name of non-UTF-8 bytes (caf\xe9.png) holds surrogates: its own bytes
        digest.update(f"{f.path}\0{f.label}\0{f.bytes}\0{f.mtime_ns}\n".encode(
            "utf-8", "surrogateescape"))
    return digest.hexdigest()
