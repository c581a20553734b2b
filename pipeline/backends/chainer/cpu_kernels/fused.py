"""BatchNorm's passes over (M, C) pixels and ReLU's gradient as loops compiled by Numba, and NumPy references with their bits.

What fixes the bits: every per-channel sum runs over the rows in order (row 0 first) in
float64, and every elementwise step is one IEEE operation in the array's dtype, in the order
written (Numba leaves LLVM's fp-contract off, so no multiply-add is fused). The reference below
sums in the same order (``_row_sums``), so it gives the compiled loops' bits where Numba is not
installed, on any CPU: no BLAS kernel takes part, whose choice differs between Intel and AMD.

Why compiled: each NumPy operation is a pass over memory, and BatchNorm's forward is three of
them plus two sums, its backward five; a loop reads a pixel's C values once per pass it needs
(forward 3 reads, backward 2). On one core of the 2-core EPYC, forward + backward 1.7-2.0x the
NumPy kernel they replace, and resnet20's BatchNorm 78 -> 43 ms a step (docs/benchmarks.md,
"Compiled passes"; ``benchmarks/batchnorm.py``).

Numba is imported and the loops compiled at the first call (cached on disk, ``cache=True``).
They release the GIL: two replicas as threads of one worker run theirs at once.
"""
from __future__ import annotations

import functools
import types

import numpy as np

from pipeline.backends.chainer.cpu_kernels import sharing
from pipeline.core import jit as compiler


_ROW = 512  # elements per widened row (the reference's elementwise steps)


def wide(a: np.ndarray, c: int):
    """(M, C) C-contiguous -> ((M/r, r*C) view, r) with r*C near _ROW and r dividing M: NumPy's
    per-call overhead dominates rows of 16 channels; a per-channel vector is then tiled r times."""
    m = a.shape[0]
    r = max(1, _ROW // c)
    while m % r:
        r -= 1
    return a.reshape(m // r, r * c), r


@functools.cache
def _compiled():
    """The compiled loops, or None where Numba cannot be imported."""
    jit = compiler.njit()
    if jit is None:  # the reference
        return None

    @jit
    def sums(x, out):
        m, c = x.shape
        for i in range(m):
            for k in range(c):
                out[k] += x[i, k]

    @jit
    def centred_square_sums(x, mean, out):
        m, c = x.shape
        for i in range(m):
            for k in range(c):
                d = x[i, k] - mean[k]
                out[k] += d * d

    @jit
    def normalize(x, mean, inv_std, gamma, beta, x_hat, y):
        m, c = x.shape
        for i in range(m):
            for k in range(c):
                h = (x[i, k] - mean[k]) * inv_std[k]
                x_hat[i, k] = h
                y[i, k] = h * gamma[k] + beta[k]

    @jit
    def grad_sums(gy, x_hat, gbeta, ggamma):
        m, c = gy.shape
        for i in range(m):
            for k in range(c):
                g = gy[i, k]
                gbeta[k] += g
                ggamma[k] += g * x_hat[i, k]

    @jit
    def grad_x(gy, x_hat, scale, a, b, gx):
        m, c = gy.shape
        for i in range(m):
            for k in range(c):
                gx[i, k] = gy[i, k] * scale[k] - (x_hat[i, k] * a[k] + b[k])

    @jit
    def relu_grad(gy, y, one, zero, gx):
        for i in range(gy.size):
            gx[i] = gy[i] * (one if y[i] > 0 else zero)

    @jit
    def relu(x, zero, y):
        for i in range(x.size):
            v = x[i]
            y[i] = v if (v > zero or v != v) else zero  # np.maximum(v, 0): NaN kept, -0.0 -> 0

    return types.SimpleNamespace(sums=sums, centred_square_sums=centred_square_sums,
                                 normalize=normalize, grad_sums=grad_sums, grad_x=grad_x,
                                 relu_grad=relu_grad, relu=relu)


def compiled() -> bool:
    """Whether the Numba loops run (else the NumPy reference, same bits)."""
    return _compiled() is not None


def _row_sums(a: np.ndarray) -> np.ndarray:
    """(M, C) C-contiguous -> (C,) float64: the sequential sum over rows (the loops' order).

    NumPy reduces over the outer axis of a C-contiguous matrix row after row (the inner loop
    adds a row into the C sums), which is this order; over a single column (C = 1) it would sum
    pairwise, so that case takes ``cumsum``, sequential by definition (15x slower). The tests
    hold both to the compiled loops on sums whose order shows in the bits.
    """
    if a.shape[0] == 0:
        return np.zeros(a.shape[1], np.float64)
    if a.shape[1] == 1:
        sums = np.cumsum(a, axis=0, dtype=np.float64)[-1]
    else:
        sums = np.add.reduce(a, axis=0, dtype=np.float64)
    sums += 0.0  # the loops start from +0.0: a sum of -0.0 terms alone is +0.0 there
    return sums


SLICE = 1 << 17  # elements per slice of an element-wise loop that threads share


def _by_slices(fn, size: int, row: int = 1) -> None:
    """``fn(lo, hi)`` over [0, size) rows of ``row`` elements in fixed slices of about ``SLICE``
    elements shared among ``sharing.threads()`` threads: element-wise work (row by row), so
    the same bits at any count. The per-channel sums stay one sequential loop each (their
    order is their bits)."""
    sharing.each(fn, sharing.slices(size, max(1, SLICE // max(1, row))))


def statistics(x: np.ndarray, use_compiled: bool = True) -> tuple:
    """(M, C) C-contiguous x -> (mean, biased variance) in x's dtype.

    mean = sum(x) / M, var = sum((x - mean)^2) / M, sums in float64 and rounded once.
    """
    m, c = x.shape
    loops = _compiled() if use_compiled else None
    if loops is None:
        s = _row_sums(x)
    else:
        s = np.zeros(c, np.float64)
        loops.sums(x, s)
    mean = (s / max(m, 1)).astype(x.dtype)
    if loops is None:
        xw, r = wide(x, c)
        v = _row_sums(np.square(xw - np.tile(mean, r)).reshape(m, c))
    else:
        v = np.zeros(c, np.float64)
        loops.centred_square_sums(x, mean, v)
    return mean, (v / max(m, 1)).astype(x.dtype)


def normalize(x, mean, inv_std, gamma, beta, use_compiled: bool = True) -> tuple:
    """(y, x_hat): x_hat = (x - mean) * inv_std, y = x_hat * gamma + beta, per channel."""
    loops = _compiled() if use_compiled else None
    if loops is None:
        m, c = x.shape
        xw, r = wide(x, c)
        x_hat = np.subtract(xw, np.tile(mean, r))
        x_hat *= np.tile(inv_std, r)
        y = np.multiply(x_hat, np.tile(gamma, r))
        y += np.tile(beta, r)
        return y.reshape(m, c), x_hat.reshape(m, c)
    x_hat, y = np.empty_like(x), np.empty_like(x)
    _by_slices(lambda lo, hi: loops.normalize(x[lo:hi], mean, inv_std, gamma, beta, x_hat[lo:hi],
                                              y[lo:hi]), x.shape[0], x.shape[1])
    return y, x_hat


def grad_sums(gy, x_hat, use_compiled: bool = True) -> tuple:
    """(gbeta, ggamma) in gy's dtype: sum(gy), sum(gy * x_hat) per channel."""
    loops = _compiled() if use_compiled else None
    if loops is None:
        gbeta, ggamma = _row_sums(gy), _row_sums(np.multiply(gy, x_hat))
    else:
        gbeta, ggamma = np.zeros(gy.shape[1], np.float64), np.zeros(gy.shape[1], np.float64)
        loops.grad_sums(gy, x_hat, gbeta, ggamma)
    return gbeta.astype(gy.dtype), ggamma.astype(gy.dtype)


def grad_x(gy, x_hat, scale, a, b, use_compiled: bool = True) -> np.ndarray:
    """gx = gy * scale - (x_hat * a + b), per channel."""
    loops = _compiled() if use_compiled else None
    if loops is None:
        m, c = gy.shape
        gyw, r = wide(gy, c)
        tmp = np.multiply(x_hat.reshape(gyw.shape), np.tile(a, r))
        tmp += np.tile(b, r)
        gx = np.multiply(gyw, np.tile(scale, r))
        gx -= tmp
        return gx.reshape(m, c)
    gx = np.empty_like(gy)
    _by_slices(lambda lo, hi: loops.grad_x(gy[lo:hi], x_hat[lo:hi], scale, a, b, gx[lo:hi]),
               gy.shape[0], gy.shape[1])
    return gx


def _flat(*arrays) -> list | None:
    """1-D views of arrays of one shape and the same strides, in their memory order, or None
    where one is not dense (an element-wise loop over them then needs no index arithmetic)."""
    order = np.argsort([-abs(st) for st in arrays[0].strides], kind="stable")
    views = [a.transpose(order) for a in arrays]
    if any(a.strides != arrays[0].strides or not v.flags.c_contiguous
           for a, v in zip(arrays, views)):
        return None
    return [v.reshape(-1) for v in views]


def relu_grad(gy: np.ndarray, y: np.ndarray, use_compiled: bool = True) -> np.ndarray:
    """gx = gy * (y > 0): Chainer's ReLU gradient (a bool mask times gy, so -0.0 where gy < 0
    and the mask is off, NaN where gy is infinite), in one pass where ``gy`` and ``y`` share
    a dense layout (the channels-last arrays our kernels hand Chainer)."""
    loops = _compiled() if use_compiled else None
    gx = np.empty_like(gy)  # gy's memory order
    flat = None if loops is None or y.dtype != gy.dtype else _flat(gy, y, gx)
    if flat is None:
        return np.asarray(gy * (y > 0), dtype=gy.dtype)
    one, zero = gy.dtype.type(1), gy.dtype.type(0)
    _by_slices(lambda lo, hi: loops.relu_grad(flat[0][lo:hi], flat[1][lo:hi], one, zero,
                                              flat[2][lo:hi]), gy.size)
    return gx


def relu(x: np.ndarray, use_compiled: bool = True) -> np.ndarray:
    """y = np.maximum(x, 0) in x's dtype and memory order (Chainer's ReLU forward: NaN passes,
    -0.0 gives 0.0 as NumPy's maximum gives its second operand on ties), in one pass where x
    is dense."""
    loops = _compiled() if use_compiled else None
    y = np.empty_like(x)
    flat = None if loops is None else _flat(x, y)
    if flat is None:
        return np.maximum(x, 0, dtype=x.dtype)
    zero = x.dtype.type(0)
    _by_slices(lambda lo, hi: loops.relu(flat[0][lo:hi], zero, flat[1][lo:hi]), x.size)
    return y
