"""Max and average pooling on the CPU in NumPy, channels-last, as two 1-D passes (along W, then H).

A 2-D window's max is the max along H of the maxima along W, and taking W first keeps Chainer's
tie rule: its argmax is the first maximum in row-major (dy, dx) order, which is the first row
holding the maximum, and within it the first column. Each 1-D pass is k strided, vectorized
NumPy operations over the whole batch (k = window length), never a loop over pixels; the argmax
is kept per pass as uint8 offsets for the backward scatter. Shapes: x (N, H, W, C).
"""
from __future__ import annotations

import numpy as np

from pipeline.backends.chainer.cpu_kernels import pooling_compiled, sharing
from pipeline.backends.chainer.cpu_kernels.layout import out_size


def _taps(size: int, length: int, k: int, s: int, p: int):
    """For each offset d of a window: (d, j0, j1, i0) with outputs [j0, j1) reading inputs i0::s.

    Output j at offset d reads input j*s + d - p; offsets falling on padding are left out.
    """
    taps = []
    for d in range(k):
        j0 = max(0, -((d - p) // s))  # first j with j*s + d - p >= 0
        j1 = min(length, (size - 1 - d + p) // s + 1)
        if j1 > j0:
            taps.append((d, j0, j1, j0 * s + d - p))
    return taps


def _along(a: np.ndarray, axis: int, start: int, stop: int | None = None, step: int = 1):
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop, step)
    return a[tuple(index)]


def _split(axis: int, ndim: int, s: int) -> bool:
    """Whether a pass along ``axis`` at stride ``s`` works on residue classes (see ``_class``).

    Along W (the axis before the channels) at a stride > 1 every tap is a strided view whose
    contiguous runs are only C elements, and NumPy pays one inner-loop call per run: pool1 of
    cifar10-2015 (32 channels) spent 7.8 ms in its W pass against 1.9 ms for its H pass, whose
    runs are whole W*C rows; 4.6 ms with the classes (caches warm; pool1's whole forward with
    caches flushed: 8.6-9.9 -> 7.4-9.1 ms). Along H, or at stride 1, runs are already long. The
    backward scatter into classes (interleaved at the end) gained nothing and was not kept.
    """
    return s > 1 and axis == ndim - 2


def _class(x, r: int, s: int):
    """(N, H, W, C) -> x[:, :, r::s] as a C-contiguous array (residue class r of the W axis).

    Input j*s + d - p of a tap lies in class (d - p) % s at index j + (d - p) // s, so every tap
    becomes a slice of one class whose (length, C) block is contiguous; the classes together
    are one copy of x. The copy moves each C-element run as one void element (a memmove each,
    as the im2col copy does).
    """
    n, h, _, c = x.shape
    runs = np.ascontiguousarray(x).view(np.dtype((np.void, c * x.itemsize)))[..., 0]
    return np.ascontiguousarray(runs[:, :, r::s]).view(x.dtype).reshape(n, h, -1, c)


def _source(x, axis: int, s: int):
    """``src(i0, count)``: the inputs i0, i0 + s, ... (count of them) along ``axis``, as a view."""
    if not _split(axis, x.ndim, s):
        return lambda i0, count: _along(x, axis, i0, i0 + s * count, s)
    parts = {}

    def src(i0, count):
        if i0 % s not in parts:
            parts[i0 % s] = _class(x, i0 % s, s)
        return _along(parts[i0 % s], axis, i0 // s, i0 // s + count)
    return src


def _max1d(x, axis: int, k: int, s: int, p: int, length: int, with_arg: bool = True,
           compiled: bool = True):
    """Max over windows along ``axis``: -> (values, uint8 offset of the first maximum or None).

    By ``pooling_compiled``'s loop where Numba is there (the same bits), unless ``compiled`` is
    False (the NumPy reference, for tests)."""
    shape = list(x.shape)
    shape[axis] = length
    taps = _taps(x.shape[axis], length, k, s, p)
    if compiled and pooling_compiled.loops() is not None:
        return pooling_compiled.max1d(x, axis, taps, s, p, length, with_arg)
    source = _source(x, axis, s) if taps else None
    full = [t[1:3] == (0, length) for t in taps]
    y = np.empty(shape, x.dtype)
    arg = None
    if len(taps) > 1 and full[0] and full[1]:  # the usual start: two whole taps, one pass each
        (d0, _, _, i0), (d1, _, _, i1) = taps[:2]
        first, second = source(i0, length), source(i1, length)
        if with_arg:
            arg = np.greater(second, first).view(np.uint8)  # 1 where the second is strictly larger
            if (d0, d1) != (0, 1):
                arg = arg * np.uint8(d1 - d0) + np.uint8(d0)
        np.maximum(first, second, out=y)  # like Chainer's max: a NaN in the window wins
        taps = taps[2:]
    elif full[0]:
        d0, _, _, i0 = taps[0]
        np.copyto(y, source(i0, length))
        arg = np.full(shape, d0, np.uint8) if with_arg else None
        taps = taps[1:]
    else:
        y.fill(-np.inf)
        arg = np.zeros(shape, np.uint8) if with_arg else None
    if with_arg and taps:
        wins, tap_arg = np.empty(shape, bool), np.empty(shape, np.uint8)
    for d, j0, j1, i0 in taps:
        src = source(i0, j1 - j0)
        dst = _along(y, axis, j0, j1)
        if with_arg:
            w = _along(wins, axis, j0, j1)
            np.greater(src, dst, out=w)
            # offsets come in increasing order, so the last win is the largest:
            # arg = max(arg, d * win) (masked writes, `where=`, ran 15x slower here)
            t = _along(tap_arg, axis, j0, j1)
            np.multiply(w, np.uint8(d), out=t)
            a = _along(arg, axis, j0, j1)
            np.maximum(a, t, out=a)
        np.maximum(dst, src, out=dst)
    return y, arg


def _scatter1d(gy, axis: int, size: int, k: int, s: int, p: int, part):
    """gx with ``size`` along ``axis``: the sum over taps of ``part(d, j0, j1)`` at each tap's inputs.

    Inputs i = j*s + d - p of taps whose ``(d - p) mod s`` agree interleave; the first tap of
    such a class that covers all of it is written in place (no zero fill, no add), as is every
    class with one tap when the stride is the window (non-overlapping pooling).
    """
    shape = list(gy.shape)
    shape[axis] = size
    gx = np.empty(shape, gy.dtype)
    started = set()
    for d, j0, j1, i0 in _taps(size, gy.shape[axis], k, s, p):
        cls = i0 % s
        dst = _along(gx, axis, i0, i0 + s * (j1 - j0), s)
        if cls not in started:
            started.add(cls)
            if i0 == cls and j1 - j0 == len(range(cls, size, s)):
                part(d, j0, j1, out=dst)
                continue
            _along(gx, axis, cls, None, s).fill(0)
        dst += part(d, j0, j1)
    for cls in set(range(s)) - started:  # inputs no window reads
        _along(gx, axis, cls, None, s).fill(0)
    return gx


def _max1d_grad(gy, arg, axis: int, size: int, k: int, s: int, p: int, compiled: bool = True):
    """Route gy back along ``axis`` to the offsets in ``arg``; -> gradient with ``size`` there."""
    if compiled and pooling_compiled.loops() is not None:
        return pooling_compiled.max1d_grad(gy, arg, axis, size, _taps(size, gy.shape[axis], k, s, p),
                                           s, p)
    def part(d, j0, j1, out=None):
        return np.multiply(_along(gy, axis, j0, j1), _along(arg, axis, j0, j1) == d, out=out)
    return _scatter1d(gy, axis, size, k, s, p, part)


def _max_pool(x, ksize: tuple, stride: tuple, pad: tuple, cover_all: bool, with_arg: bool):
    (kh, kw), (sy, sx), (ph, pw) = ksize, stride, pad
    n, h, w, c = x.shape
    ho, wo = out_size(h, kh, sy, ph, cover_all), out_size(w, kw, sx, pw, cover_all)
    t, arg_w = _max1d(x, 2, kw, sx, pw, wo, with_arg)
    y, arg_h = _max1d(t, 1, kh, sy, ph, ho, with_arg)
    return y, ((arg_w, arg_h) if with_arg else None)


def _max_pool_grad(gy, state, x_shape: tuple, ksize: tuple, stride: tuple, pad: tuple):
    (kh, kw), (sy, sx), (ph, pw) = ksize, stride, pad
    arg_w, arg_h = state
    gt = _max1d_grad(gy, arg_h, 1, x_shape[1], kh, sy, ph)
    return _max1d_grad(gt, arg_w, 2, x_shape[2], kw, sx, pw)


def _by_images(fn, n: int, shape: tuple, dtype, threads: int):
    """(output of shape ``shape``, [(lo, hi, fn's extra) for each part]) with ``fn(lo, hi)``
    returning (out part, extra) for images [lo, hi): one call for one thread, else contiguous
    parts of the batch shared among threads (``cpu_kernels.sharing``), each part's out copied
    into place. Every image sees the one-thread operations: the same bits."""
    parts = sharing.ranges(n, threads)
    if len(parts) == 1:
        out, extra = fn(0, n)
        return out, [(0, n, extra)]
    out = np.empty(shape, dtype)

    def run(share):
        extras = []
        for lo, hi in share:
            part, extra = fn(lo, hi)
            out[lo:hi] = part
            extras.append((lo, hi, extra))
        return extras
    return out, sharing.in_order(sharing.run(run, sharing.deal(parts, threads)))


def max_pool(x, ksize: tuple, stride: tuple, pad: tuple, cover_all: bool = True,
             with_arg: bool = True, threads: int = 1):
    """(N, H, W, C) -> (y (N, Ho, Wo, C), state for ``max_pool_grad``); padding never wins.

    ``with_arg=False`` (inference) skips the argmax bookkeeping and returns no state. With
    ``threads`` > 1 the batch is cut into that many parts run on their own threads.
    """
    (kh, kw), (sy, sx), (ph, pw) = ksize, stride, pad
    n, h, w, c = x.shape
    ho, wo = out_size(h, kh, sy, ph, cover_all), out_size(w, kw, sx, pw, cover_all)
    y, parts = _by_images(
        lambda lo, hi: _max_pool(x[lo:hi], ksize, stride, pad, cover_all, with_arg),
        n, (n, ho, wo, c), x.dtype, threads)
    return y, (parts if with_arg else None)


def max_pool_grad(gy, state, x_shape: tuple, ksize: tuple, stride: tuple, pad: tuple):
    """gy (N, Ho, Wo, C) -> gx (N, H, W, C): each output's gradient to its window's argmax."""
    by_start = {lo: st for lo, _, st in state}  # the forward's parts: the same cuts again
    gx, _ = _by_images(
        lambda lo, hi: (_max_pool_grad(gy[lo:hi], by_start[lo], (hi - lo, *x_shape[1:]),
                                       ksize, stride, pad), None),
        x_shape[0], x_shape, gy.dtype, len(state))
    return gx


def _sum1d(x, axis: int, k: int, s: int, p: int, length: int):
    shape = list(x.shape)
    shape[axis] = length
    y = np.empty(shape, x.dtype)
    taps = _taps(x.shape[axis], length, k, s, p)
    if not (taps and taps[0][1:3] == (0, length)):
        y.fill(0)
    for n, (d, j0, j1, i0) in enumerate(taps):
        src = _along(x, axis, i0, i0 + s * (j1 - j0), s)
        if n == 0 and (j0, j1) == (0, length):
            np.copyto(y, src)
        else:
            dst = _along(y, axis, j0, j1)
            dst += src
    return y


def _sum1d_grad(gy, axis: int, size: int, k: int, s: int, p: int):
    def part(d, j0, j1, out=None):
        src = _along(gy, axis, j0, j1)
        return src.copy() if out is None else np.copyto(out, src)
    return _scatter1d(gy, axis, size, k, s, p, part)


def average_pool(x, ksize: tuple, stride: tuple, pad: tuple):
    """(N, H, W, C) -> (N, Ho, Wo, C): window sums over kh*kw, padding counted as zeros (Chainer's rule)."""
    (kh, kw), (sy, sx), (ph, pw) = ksize, stride, pad
    n, h, w, c = x.shape
    ho, wo = out_size(h, kh, sy, ph), out_size(w, kw, sx, pw)
    y = _sum1d(_sum1d(x, 2, kw, sx, pw, wo), 1, kh, sy, ph, ho)
    y /= kh * kw  # divided after summing, as Chainer's mean does
    return y


def average_pool_grad(gy, x_shape: tuple, ksize: tuple, stride: tuple, pad: tuple):
    (kh, kw), (sy, sx), (ph, pw) = ksize, stride, pad
    gx = _sum1d_grad(_sum1d_grad(gy, 1, x_shape[1], kh, sy, ph), 2, x_shape[2], kw, sx, pw)
    gx /= kh * kw
    return gx
