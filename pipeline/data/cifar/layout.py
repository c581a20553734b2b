"""The CIFAR formats' files and size limits, and the values that name a batch, a chunk or a source.

Formats (https://www.cs.toronto.edu/~kriz/cifar.html):

* CIFAR-10 python, ``cifar-10-batches-py/``: ``data_batch_1`` .. ``data_batch_5``, ``test_batch``
  and ``batches.meta``, each a Python 2 pickle (protocol 2) of a dict with bytes keys. A batch
  holds ``b'data'`` (uint8 ``(N, 3072)``, rows are R then G then B planes of 32x32),
  ``b'labels'`` (list of int), ``b'batch_label'`` and ``b'filenames'``.
* CIFAR-10 binary, ``cifar-10-batches-bin/``: ``data_batch_1.bin`` .. ``test_batch.bin`` of
  3073-byte records (one label byte, then the 3072 image bytes) and ``batches.meta.txt``.
* CIFAR-100 python, ``cifar-100-python/``: ``train``, ``test`` and ``meta`` pickles with
  ``b'fine_labels'`` (100 classes) and ``b'coarse_labels'`` (20).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

IMAGE_SHAPE = (3, 32, 32)
IMAGE_BYTES = 3 * 32 * 32
RECORD_BYTES = 1 + IMAGE_BYTES  # binary version: one label byte, then the image
# The largest official file holds 50,000 images (CIFAR-100's train); we allow all 60,000 images
# of CIFAR-10 in one file. Reads are capped by what a file of that many images can be, so a
# huge, sparse or endless file is refused before it is read.
MAX_IMAGES_PER_FILE = 60_000
_PICKLE_OVERHEAD = 256  # bytes per image besides its pixels: labels, a file name, opcodes (~60)
MAX_PYTHON_BATCH_BYTES = MAX_IMAGES_PER_FILE * (IMAGE_BYTES + _PICKLE_OVERHEAD)
MAX_BINARY_BATCH_BYTES = MAX_IMAGES_PER_FILE * RECORD_BYTES
MAX_META_BYTES = 1 << 20  # 10 or 120 class names; the official meta files are < 2 KB
TRAIN_BATCHES = 5  # CIFAR-10 splits its 50,000 training images over five batch files
CIFAR10_LABEL_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                       "ship", "truck")
SPLITS = {"train": 0, "test": 1}  # split ids in the synthetic generator's RNG coordinates


@dataclasses.dataclass(frozen=True)
class Layout:
    """The files of one official format."""
    key: str  # "cifar10-python" | "cifar10-binary" | "cifar100-python"
    top: str  # directory name, inside the official archive and when extracted
    archive: str  # official archive file name
    train: tuple[str, ...]  # training batch files, in order
    test: tuple[str, ...]  # test batch files
    meta: str  # the file with the label names
    optional: tuple[str, ...]  # files the official archive also holds


LAYOUTS = {
    "cifar10-python": Layout("cifar10-python", "cifar-10-batches-py", "cifar-10-python.tar.gz",
                             tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",),
                             "batches.meta", ("readme.html",)),
    "cifar10-binary": Layout("cifar10-binary", "cifar-10-batches-bin", "cifar-10-binary.tar.gz",
                             tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
                             ("test_batch.bin",),
                             "batches.meta.txt", ("readme.html",)),
    "cifar100-python": Layout("cifar100-python", "cifar-100-python", "cifar-100-python.tar.gz",
                              ("train",), ("test",), "meta", ("file.txt~",)),
}


def layout_of_top(top: str) -> Layout | None:
    """The layout whose directory is ``top``, or None."""
    return next((lay for lay in LAYOUTS.values() if lay.top == top), None)


@dataclasses.dataclass(frozen=True)
class BatchFile:
    """One batch file, enough for any worker that sees the same path to read it."""
    layout: str  # key of LAYOUTS
    path: str  # the batch file, or the tarball that holds it
    member: str | None = None  # member name inside the tarball; None for a plain file
    label_kind: str = "fine"  # CIFAR-100 only: "fine" or "coarse" labels
    n: int = -1  # images found when the source was scanned (-1: not scanned); load() checks it

    @property
    def where(self) -> str:
        """How errors name this file: ``path`` or ``archive:member``."""
        return f"{self.path}:{self.member}" if self.member else self.path


@dataclasses.dataclass(frozen=True)
class SyntheticChunk:
    """One synthetic chunk, made on whichever worker runs it: the same bytes anywhere."""
    seed: int  # data seed
    split: str  # "train" | "test"
    index: int  # chunk number within the split (the batch file number minus one)
    n: int  # images in the chunk


class Catalog(NamedTuple):
    """What a scan of a CIFAR source found; every batch file was read once and validated."""
    layout: str  # key of LAYOUTS
    train: tuple[BatchFile, ...]  # training batch files with their image counts
    test: tuple[BatchFile, ...]
    label_names: tuple[str, ...]
    class_counts_train: tuple[int, ...]  # training images per class
    stamp: tuple  # (path, size, mtime_ns) of every file read: same stamp, same data
