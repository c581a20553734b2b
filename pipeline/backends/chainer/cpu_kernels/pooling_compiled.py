"""Max pooling's 1-D passes as loops compiled by Numba, with the bits of ``pooling``'s NumPy passes.

``pooling`` pools along W, then along H, each pass k strided NumPy operations over the batch
(and its backward a scatter of k masked products): about ten passes over memory a window, which
made pooling a fifth of a cifar10-2015 step (its first pool: 12.9 ms forward and 12.2 ms backward
on one core at batch 100). These loops do each 1-D pass in one sweep, element by element in the
order the NumPy passes take (the same comparisons, the same ``np.maximum`` rule, the same
products summed in the same order, zeros included), so they give its bits: ``pooling``'s
NumPy code stays the reference where Numba is missing, and the tests compare the two.

A pass works on x viewed as (A, L, B): the pooled axis in the middle (W of (N*H, W, C), or H
of (N, H, W*C)), B contiguous. Taps are ``pooling._taps``' (d, j0, j1, i0): output j reads input
j*s + d - p at window offset d.
"""
from __future__ import annotations

import functools

import numpy as np

from pipeline.core import jit as compiler


@functools.cache
def loops():
    """(forward, backward) compiled, or None where Numba cannot be imported."""
    jit = compiler.njit()
    if jit is None:
        return None

    @jit
    def forward(x, taps, start, y, arg, with_arg):
        # taps: (T, 3) int64 rows (d, j0, j1); start: taps[0] covers every output (copied in)
        n_a, n_l, n_b = x.shape
        s, p = taps[0, 3], taps[0, 4]
        length = y.shape[1]
        for a in range(n_a):
            for j in range(length):
                first = 0
                if start:
                    i = j * s + taps[0, 0] - p
                    for b in range(n_b):
                        y[a, j, b] = x[a, i, b]
                        if with_arg:
                            arg[a, j, b] = taps[0, 0]
                    first = 1
                else:
                    for b in range(n_b):
                        y[a, j, b] = -np.inf
                        if with_arg:
                            arg[a, j, b] = 0
                for t in range(first, taps.shape[0]):
                    d = taps[t, 0]
                    if j < taps[t, 1] or j >= taps[t, 2]:
                        continue
                    i = j * s + d - p
                    for b in range(n_b):
                        v = x[a, i, b]
                        m = y[a, j, b]
                        if with_arg and v > m:
                            arg[a, j, b] = d
                        if not (m > v or m != m):  # np.maximum(m, v): v on ties (+-0), NaN wins
                            y[a, j, b] = v

    @jit
    def backward(gy, arg, taps, inplace, gx):
        # gx[i] = sum over taps of i's class (d ascending) of gy[j] * (arg[j] == d): the first
        # tap of a class written in place where it covers the class, else added to a zero
        n_a, n_size, n_b = gx.shape
        s, p = taps[0, 3], taps[0, 4]
        one, zero = gx.dtype.type(1), gx.dtype.type(0)
        for a in range(n_a):
            for i in range(n_size):
                cls = i % s
                for b in range(n_b):
                    gx[a, i, b] = zero
                started = False
                for t in range(taps.shape[0]):
                    d = taps[t, 0]
                    if (d - p) % s != cls:
                        continue
                    j = (i - d + p) // s
                    covered = taps[t, 1] <= j < taps[t, 2] and (i - d + p) % s == 0
                    if not started:
                        started = True
                        if inplace[cls]:
                            for b in range(n_b):
                                gx[a, i, b] = gy[a, j, b] * (one if arg[a, j, b] == d else zero)
                            continue
                    if covered:
                        for b in range(n_b):
                            gx[a, i, b] += gy[a, j, b] * (one if arg[a, j, b] == d else zero)

    return forward, backward


def _as_3d(a: np.ndarray, axis: int) -> np.ndarray:
    """(N, H, W, C) C-contiguous -> (A, L, B) with ``axis`` (1 or 2) as L."""
    n, h, w, c = a.shape
    return a.reshape(n, h, w * c) if axis == 1 else a.reshape(n * h, w, c)


def _tap_table(taps, s: int, p: int) -> np.ndarray:
    return np.array([(d, j0, j1, s, p) for d, j0, j1, _ in taps], np.int64).reshape(-1, 5)


def max1d(x, axis: int, taps, s: int, p: int, length: int, with_arg: bool):
    """``pooling._max1d`` (the same values and offsets) by the compiled loop."""
    forward, _ = loops()
    x = np.ascontiguousarray(x)
    shape = list(x.shape)
    shape[axis] = length
    y = np.empty(shape, x.dtype)
    arg = np.empty(shape, np.uint8) if with_arg else np.empty((1, 1, 1), np.uint8)
    table = _tap_table(taps, s, p)
    start = bool(taps) and taps[0][1:3] == (0, length)
    if table.shape[0] == 0:  # no tap reaches the input: -inf outputs, offset 0
        y.fill(-np.inf)
        arg.fill(0)
        return y, (arg if with_arg else None)
    forward(_as_3d(x, axis), table, start, _as_3d(y, axis),
            _as_3d(arg, axis) if with_arg else arg, with_arg)
    return y, (arg if with_arg else None)


def max1d_grad(gy, arg, axis: int, size: int, taps, s: int, p: int):
    """``pooling._max1d_grad`` (the same bits) by the compiled loop."""
    _, backward = loops()
    gy, arg = np.ascontiguousarray(gy), np.ascontiguousarray(arg)
    shape = list(gy.shape)
    shape[axis] = size
    gx = np.empty(shape, gy.dtype)
    if not taps:
        gx.fill(0)
        return gx
    inplace = np.zeros(s, np.bool_)
    seen = set()
    for d, j0, j1, i0 in taps:  # a class starts in place where its first tap covers it
        cls = i0 % s
        if cls not in seen:
            seen.add(cls)
            inplace[cls] = i0 == cls and j1 - j0 == len(range(cls, size, s))
    backward(_as_3d(gy, axis), _as_3d(arg, axis), _tap_table(taps, s, p), inplace,
             _as_3d(gx, axis))
    return gx
