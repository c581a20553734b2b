"""Numba where it can be imported: the one decorator our compiled loops are built with.

Each compiled loop (BatchNorm's passes and ReLU's gradient in
``backends/chainer/cpu_kernels/fused.py``, the exact mean in ``averaging/compiled.py``) has a
NumPy reference with the same bits, so Numba is optional: :func:`njit` gives the decorator, or
None where Numba cannot be imported (not installed, or not built for this NumPy) and the
reference runs. Numba is imported at the first call that wants a loop, not before: its import
and its compiler's start cost a fresh process ~0.9 s (docs/benchmarks.md).
"""
from __future__ import annotations

import functools


@functools.cache
def njit():
    """``numba.njit(cache=True, nogil=True)``: each loop compiled once and cached on disk, and
    run without the GIL (two replicas as threads of one worker run theirs at once); None where
    Numba cannot be imported."""
    try:
        import numba
    except Exception:  # noqa: BLE001  not installed, or not for this NumPy: the references
        return None
    return numba.njit(cache=True, nogil=True)
