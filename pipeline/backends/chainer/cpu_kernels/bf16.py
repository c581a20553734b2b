"""float32 <-> bfloat16 on NumPy: bf16 held as the uint16 of its bits (NumPy has no bf16 dtype).

bf16 is float32's upper 16 bits: its sign, its 8-bit exponent and 7 of its 23 mantissa bits
(8 with the implicit one), so a rounding's relative error is at most 2^-8 (half an ulp). Rounding
is to nearest, ties to even, as oneDNN's own reorders round. A NaN whose payload sits in the low
16 bits only becomes an infinity here: still non-finite, which the run's checks catch.
"""
from __future__ import annotations

import numpy as np


def to_bf16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 (any shape) -> uint16 of the same shape: the bf16 nearest x, ties to even.

    >>> v = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-7 + 2**-9, -2.5], np.float32)
    >>> from_bf16(to_bf16(v)).tolist()
    [1.0, 1.0, 1.015625, 1.0078125, -2.5]
    >>> hex(int(to_bf16(np.ones(1, np.float32))[0]))
    '0x3f80'
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = np.right_shift(u, 16)
    np.bitwise_and(lsb, 1, out=lsb)
    lsb += 0x7FFF
    lsb += u  # overflows past the largest finite bf16 to inf, as rounding should
    np.right_shift(lsb, 16, out=lsb)
    if out is None:
        return lsb.astype(np.uint16)
    np.copyto(out, lsb, casting="unsafe")
    return out


def from_bf16(b: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits (any shape) -> float32 of the same shape, exactly.

    >>> from_bf16(np.array([0x3f80, 0xc020], np.uint16)).tolist()
    [1.0, -2.5]
    """
    return np.left_shift(np.asarray(b, np.uint16).astype(np.uint32), 16).view(np.float32)
