"""Channels-last (NHWC) helpers: views between Chainer's NCHW shapes and NHWC memory, padding, window views.

Our kernels hand Chainer arrays of NCHW *shape* whose memory is NHWC (``y.transpose(0, 3, 1, 2)``
of a C-contiguous (N, H, W, C) array), as Chainer's own CPU convolution already does with its
tensordot output. Elementwise functions (ReLU, dropout, BatchNorm's arithmetic) keep that layout
(NumPy's ufuncs allocate outputs in the input's memory order), so the next kernel reads it back
with a free transpose instead of a copy.
"""
from __future__ import annotations

import numpy as np


def to_nhwc(x: np.ndarray) -> np.ndarray:
    """(N, C, H, W) of any memory order -> C-contiguous (N, H, W, C); free when x is channels-last."""
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1))


def to_nchw(y: np.ndarray) -> np.ndarray:
    """C-contiguous (N, H, W, C) -> an (N, C, H, W) view of the same memory (no copy)."""
    return y.transpose(0, 3, 1, 2)


def out_size(size: int, k: int, s: int, p: int, cover_all: bool = False) -> int:
    """Output length of a window of ``k`` at stride ``s`` over ``size`` padded by ``p`` (Chainer's rule)."""
    if cover_all:
        return (size + 2 * p - k + s - 1) // s + 1
    return (size + 2 * p - k) // s + 1


def pad_nhwc(x: np.ndarray, ph: int, pw: int, hi_h: int | None = None, hi_w: int | None = None,
             value: float = 0.0) -> np.ndarray:
    """(N, H, W, C) -> (N, ph + H + hi_h, pw + W + hi_w, C) with the border set to ``value``.

    ``hi_h``/``hi_w`` (default ``ph``/``pw``) pad the bottom and right. Only the border is
    written besides the one copy of ``x``.
    """
    hi_h = ph if hi_h is None else hi_h
    hi_w = pw if hi_w is None else hi_w
    if ph == pw == hi_h == hi_w == 0:
        return x
    n, h, w, c = x.shape
    out = np.empty((n, ph + h + hi_h, pw + w + hi_w, c), x.dtype)
    out[:, :ph] = value
    out[:, ph + h:] = value
    out[:, ph:ph + h, :pw] = value
    out[:, ph:ph + h, pw + w:] = value
    out[:, ph:ph + h, pw:pw + w] = x
    return out

