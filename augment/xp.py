"""The one place that decides NumPy or CuPy: the array module is taken from the data."""
from __future__ import annotations

import numpy as np

try:  # CuPy is optional: present on GPU workers only.
    import cupy as _cupy
except Exception:  # ImportError, or a CUDA driver that fails at import
    _cupy = None


def array_module(array):
    """``cupy`` for a CuPy array, else ``numpy``.

    >>> array_module(np.zeros(1)) is np
    True
    """
    if _cupy is not None and isinstance(array, _cupy.ndarray):
        return _cupy
    return np


def to_host(array) -> np.ndarray:
    """Any array -> NumPy array on the host."""
    if _cupy is not None and isinstance(array, _cupy.ndarray):
        return _cupy.asnumpy(array)
    return np.asarray(array)
