"""BatchNorm followed by ReLU, and an addition followed by ReLU, each as one pass: the bits of the two functions run one after the other.

ResNet's blocks are ``relu(bn(conv(x)))`` and ``relu(h + shortcut)``. Run as two functions,
each ReLU is a pass over memory of its own (read the input, write the output) and its gradient
another (read the gradient and the output, write the product): on float32 activations these
passes were a fifth of resnet20's step, and the step is bound by memory traffic there. Here the
ReLU is applied as BatchNorm's normalization writes its output, and its gradient is formed from
the BatchNorm output recomputed from ``x_hat`` (``x_hat * gamma + beta``, the forward's own
operations) inside BatchNorm's two backward passes; an addition writes ``relu(a + b)`` at once.
Every element sees the operations the separate functions apply, in their order and precision
(``np.maximum(v, 0)``'s rule: NaN kept, -0.0 to 0.0; the gradient ``gy * (y > 0)``), so the
bits are those of BatchNorm then ReLU (``cpu_kernels.fused`` and ``activations``), which the
NumPy references below compose and the tests compare.
"""
from __future__ import annotations

import functools
import types

import numpy as np

from pipeline.backends.chainer.cpu_kernels import fused
from pipeline.core import jit as compiler


@functools.cache
def _compiled():
    """The compiled loops, or None where Numba cannot be imported."""
    jit = compiler.njit()
    if jit is None:
        return None

    @jit
    def normalize_relu(x, mean, inv_std, gamma, beta, zero, x_hat, y):
        m, c = x.shape
        for i in range(m):
            for k in range(c):
                h = (x[i, k] - mean[k]) * inv_std[k]
                x_hat[i, k] = h
                v = h * gamma[k] + beta[k]
                y[i, k] = v if (v > zero or v != v) else zero

    @jit
    def grad_sums_relu(gy, x_hat, gamma, beta, one, zero, gbeta, ggamma):
        m, c = gy.shape
        for i in range(m):
            for k in range(c):
                v = x_hat[i, k] * gamma[k] + beta[k]
                g = gy[i, k] * (one if v > zero else zero)
                gbeta[k] += g
                ggamma[k] += g * x_hat[i, k]

    @jit
    def grad_x_relu(gy, x_hat, gamma, beta, one, zero, scale, a, b, gx):
        m, c = gy.shape
        for i in range(m):
            for k in range(c):
                v = x_hat[i, k] * gamma[k] + beta[k]
                g = gy[i, k] * (one if v > zero else zero)
                gx[i, k] = g * scale[k] - (x_hat[i, k] * a[k] + b[k])

    @jit
    def add_relu(a, b, zero, y):
        for i in range(a.size):
            v = a[i] + b[i]
            y[i] = v if (v > zero or v != v) else zero

    return types.SimpleNamespace(normalize_relu=normalize_relu, grad_sums_relu=grad_sums_relu,
                                 grad_x_relu=grad_x_relu, add_relu=add_relu)


def _loops(use_compiled: bool):
    return _compiled() if use_compiled else None


def _relu_mask_gradient(gy, x_hat, gamma, beta):
    """The reference's ReLU gradient: gy * (y > 0) with y = x_hat * gamma + beta recomputed."""
    y = np.multiply(x_hat, gamma) + beta
    return np.asarray(gy * (y > 0), dtype=gy.dtype)


def normalize_relu(x, mean, inv_std, gamma, beta, use_compiled: bool = True) -> tuple:
    """(relu(y), x_hat) of ``fused.normalize``'s (y, x_hat), per channel, rows shared among
    ``cpu_kernel_threads``."""
    loops = _loops(use_compiled)
    if loops is None:
        y, x_hat = fused.normalize(x, mean, inv_std, gamma, beta, False)
        return np.maximum(y, 0, dtype=y.dtype), x_hat
    x_hat, y = np.empty_like(x), np.empty_like(x)
    zero = x.dtype.type(0)
    fused._by_slices(lambda lo, hi: loops.normalize_relu(x[lo:hi], mean, inv_std, gamma, beta,
                                                         zero, x_hat[lo:hi], y[lo:hi]),
                     x.shape[0], x.shape[1])
    return y, x_hat


def grad_sums_relu(gy, x_hat, gamma, beta, use_compiled: bool = True) -> tuple:
    """``fused.grad_sums`` of ReLU's gradient ``gy * (y > 0)``: (gbeta, ggamma)."""
    loops = _loops(use_compiled)
    if loops is None:
        return fused.grad_sums(_relu_mask_gradient(gy, x_hat, gamma, beta), x_hat, False)
    c = gy.shape[1]
    gbeta, ggamma = np.zeros(c, np.float64), np.zeros(c, np.float64)
    loops.grad_sums_relu(gy, x_hat, gamma, beta, gy.dtype.type(1), gy.dtype.type(0), gbeta,
                         ggamma)
    return gbeta.astype(gy.dtype), ggamma.astype(gy.dtype)


def grad_x_relu(gy, x_hat, gamma, beta, scale, a, b, use_compiled: bool = True):
    """``fused.grad_x`` of ReLU's gradient ``gy * (y > 0)``."""
    loops = _loops(use_compiled)
    if loops is None:
        return fused.grad_x(_relu_mask_gradient(gy, x_hat, gamma, beta), x_hat, scale, a, b,
                            False)
    gx = np.empty_like(gy)
    one, zero = gy.dtype.type(1), gy.dtype.type(0)
    fused._by_slices(lambda lo, hi: loops.grad_x_relu(gy[lo:hi], x_hat[lo:hi], gamma, beta,
                                                      one, zero, scale, a, b, gx[lo:hi]),
                     gy.shape[0], gy.shape[1])
    return gx


def add_relu(a: np.ndarray, b: np.ndarray, use_compiled: bool = True) -> np.ndarray:
    """np.maximum(a + b, 0) in a's dtype and memory order: one pass where a and b share a
    dense layout, slices shared among ``cpu_kernel_threads``."""
    loops = _loops(use_compiled)
    y = np.empty_like(a)
    flat = None if loops is None or a.dtype != b.dtype else fused._flat(a, b, y)
    if flat is None:
        s = a + b
        return np.maximum(s, 0, dtype=s.dtype)
    zero = a.dtype.type(0)
    fused._by_slices(lambda lo, hi: loops.add_relu(flat[0][lo:hi], flat[1][lo:hi], zero,
                                                   flat[2][lo:hi]), a.size)
    return y
