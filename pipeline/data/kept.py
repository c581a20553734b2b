"""The evaluation split a run keeps when its data cannot be found again (arrays held in memory,
``Reader.refindable`` False): ``OUT/eval-data.npz``, written at the run's start and read back
without unpickling (``pipeline.core.npz``), so ``evaluate --run`` needs the run directory alone.
"""
from __future__ import annotations

import os

import numpy as np

from pipeline.core import npz
from pipeline.core.errors import DataError

EVAL_FILE = "eval-data.npz"
# A larger split is not copied into the run (a run of arrays the size of ImageNet's val split
# would double its disk); data.json then says so and evaluate asks for --data.
MAX_KEPT_BYTES = 256 << 20


def to_keep(images: np.ndarray, labels: np.ndarray) -> dict:
    """``{"images": (M, 3, H, W) uint8, "labels": (M,) int32}``, the arrays EVAL_FILE holds.

    >>> sorted(to_keep(np.zeros((2, 3, 4, 4), np.uint8), np.arange(2)))
    ['images', 'labels']
    """
    return {"images": np.ascontiguousarray(images, np.uint8),
            "labels": np.ascontiguousarray(labels, np.int32)}


def fits(nbytes: int) -> bool:
    """Whether a split of ``nbytes`` is kept in the run directory (MAX_KEPT_BYTES)."""
    return nbytes <= MAX_KEPT_BYTES


def read(out: str | os.PathLike, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)`` of ``out``'s EVAL_FILE, every size and label checked: DataError
    naming the file for anything else (a pickle, other names, labels outside the classes)."""
    path = os.path.join(os.fspath(out), EVAL_FILE)
    arrays = npz.read(path, max_bytes=MAX_KEPT_BYTES + (1 << 20),
                      what="a run keeps of its evaluation split")
    images, labels = arrays.get("images"), arrays.get("labels")
    if set(arrays) != {"images", "labels"} or images.dtype != np.uint8 or images.ndim != 4 \
            or images.shape[1] != 3 or labels.dtype != np.int32 \
            or labels.shape != (len(images),) or len(images) == 0:
        raise DataError(f"{path}: must hold images (M, 3, H, W) uint8 and labels (M,) int32")
    if labels.min() < 0 or labels.max() >= n_classes:
        raise DataError(f"{path}: labels must be in [0, {n_classes})")
    return images, labels
