"""The task that cuts the dataset's blocks into other blocks of rows, by NumPy alone.

``datasets.row_blocks`` submits it where Dask's ``rechunk`` would run its own ``getitem`` and
``concatenate3``: unpickling those made a fresh worker import ``dask.array`` (and CuPy where
installed) on its event loop, 0.3-0.5 s in which it ran and dispatched nothing (the test set's
chunks, at the start of every run: docs/benchmarks.md). Workers import this module only.
"""
from __future__ import annotations

import numpy as np


def take_rows(spans: tuple, *blocks: np.ndarray) -> np.ndarray:
    """Rows ``lo:hi`` of each block (``spans``: one ``(lo, hi)`` per block), in order, as one new
    array: the rows ``rechunk`` would give, in memory of their own.

    >>> a, b = np.arange(6).reshape(3, 2), np.arange(6, 10).reshape(2, 2)
    >>> take_rows(((2, 3), (0, 1)), a, b).tolist()
    [[4, 5], [6, 7]]
    """
    parts = [block[lo:hi] for (lo, hi), block in zip(spans, blocks)]
    return np.array(parts[0]) if len(parts) == 1 else np.concatenate(parts)
