"""The exact mean of K same-typed float arrays as one loop compiled by Numba.

``exact._mean_blocks`` computes ``(sum in float64, in order) / count`` cast back, as five NumPy
passes over each cache-sized block (widen, widen, add, divide, cast). This loop reads each
input element once and writes each output element once, doing per element the same IEEE
operations in the same order: ``acc = x0; acc += x1; ...; out = acc / count`` in float64, then
one rounding to the output dtype (Numba leaves LLVM's fp-contract off and rounds a float64 to
float32 to nearest, as NumPy's cast does). Same bits; for the 67 MB Adam state of cifar10-2015
(params and both moments, two replicas) 100-170 ms -> see ``docs/benchmarks.md``.

Numba is imported and the loop compiled (cached on disk) at the first large mean; where it cannot
be imported, or for other dtypes (float16) or mixed ones, :func:`mean_into` says no and the
NumPy blocks run. The loop releases the GIL.
"""
from __future__ import annotations

import functools

import numpy as np

from pipeline.core import jit as compiler

MIN_SIZE = 1 << 16  # elements: below this the NumPy blocks (no compile, no Numba import)
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@functools.cache
def _kernel():
    """The compiled loop, or None where Numba cannot be imported."""
    jit = compiler.njit()
    if jit is None:
        return None

    @jit
    def mean(arrays, count, out):
        k = len(arrays)
        for i in range(out.size):
            acc = np.float64(arrays[0][i])
            for j in range(1, k):
                acc += np.float64(arrays[j][i])
            out[i] = acc / count

    return mean


def mean_into(flat: list, count, out: np.ndarray) -> bool:
    """``out[:] = (flat[0] + flat[1] + ... in float64) / count``, cast to ``out``'s dtype, by
    the compiled loop; False (nothing written) where it does not apply: Numba missing, a small
    array, or inputs that are not all one dtype of ``DTYPES`` as 1-D contiguous arrays."""
    if out.size < MIN_SIZE or out.dtype not in DTYPES:
        return False
    first = flat[0].dtype
    if first not in DTYPES or any(a.dtype != first or not a.flags.c_contiguous or a.ndim != 1
                                  for a in flat):
        return False
    kernel = _kernel()
    if kernel is None:
        return False
    kernel(tuple(flat), np.float64(count), out)
    return True
