"""Questions about the host arrays of a state dict that every layer asks: which entries are
floats, and where the first NaN or infinity is.

A state dict maps Chainer parameter paths to host NumPy arrays (``"/conv1/W"`` -> ``(64, 3, 3, 3)
float32``, ``"/bn1/N"`` -> ``() int64``).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def is_float(value) -> bool:
    """Whether an entry is averaged: real floating dtypes only (not ints, bools or complex).

    >>> is_float(np.zeros(2, np.float16)), is_float(np.array(3)), is_float(np.zeros(1, complex))
    (True, False, False)
    """
    return np.issubdtype(np.asarray(value).dtype, np.floating)


def first_nonfinite(state: Mapping) -> str | None:
    """The first key (dict order) whose array holds a NaN or an infinity, or None. Float and
    complex entries are scanned; integer and bool ones are finite by construction.

    >>> first_nonfinite({"/a": np.ones(2), "/b": np.array([1.0, np.nan]), "/n": np.array(3)})
    '/b'
    >>> first_nonfinite({"/z": np.array([1j, complex("inf")])})
    '/z'
    """
    for key, value in state.items():
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.inexact) and not np.isfinite(value).all():
            return key
    return None
