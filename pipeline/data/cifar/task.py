"""The ``load-`` task: one CIFAR batch file or synthetic chunk -> validated images and labels."""
from __future__ import annotations

import numpy as np

from pipeline.core.errors import DataError
from pipeline.data.cifar.archive import read_archive, read_file
from pipeline.data.cifar.layout import LAYOUTS, BatchFile, SyntheticChunk
from pipeline.data.cifar.parse import parse_batch
from pipeline.data.cifar.synthetic import synthetic_batch


def load(chunk: BatchFile | SyntheticChunk) -> tuple[np.ndarray, np.ndarray]:
    """The ``load-`` task: one batch file (or synthetic chunk) -> images and labels.

    Returns images ``(n, 3, 32, 32) uint8`` and labels ``(n,) int32``, read in one pass.

    >>> images, labels = load(SyntheticChunk(seed=0, split="train", index=0, n=4))
    >>> images.shape, images.dtype, labels.dtype
    ((4, 3, 32, 32), dtype('uint8'), dtype('int32'))
    """
    if isinstance(chunk, SyntheticChunk):
        return synthetic_batch(chunk.seed, chunk.split, chunk.index, chunk.n)
    lay = LAYOUTS[chunk.layout]
    if chunk.member is None:
        raw = read_file(chunk.path, lay)
    else:
        raw = read_archive(chunk.path, {chunk.member})[1].get(chunk.member)
        if raw is None:
            raise DataError(f"{chunk.where}: missing from the archive")
    images, labels = parse_batch(chunk.layout, raw, chunk.where, chunk.label_kind)
    if chunk.n >= 0 and len(labels) != chunk.n:
        raise DataError(f"{chunk.where}: holds {len(labels)} images but held {chunk.n} when the "
                        "dataset was opened (the file changed)")
    return images, labels
