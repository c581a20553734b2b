"""Batch normalization on the CPU, channels-last: x is an (M, C) matrix, M = N*H*W pixels.

The passes over the pixels are ``cpu_kernels.fused``'s (loops compiled by Numba, or a NumPy
reference with the same bits): per-channel sums sequential over the rows in float64, so the
bits depend on no BLAS kernel. Chainer's formulas, in its order where it matters: biased batch
variance for normalizing, unbiased for the running average, ``inv_std = 1 / sqrt(var + eps)``.
Inference (``fixed_forward``) is one scaling and one shift on rows widened to a few hundred
elements (``fused.wide``).
"""
from __future__ import annotations

import numpy as np

from pipeline.backends.chainer.cpu_kernels import fused, fused_relu


def forward(x, gamma, beta, eps: float, running=None, decay: float = 0.9, relu: bool = False):
    """Training-mode BN of (M, C) x with batch statistics -> (y, x_hat, inv_std).

    ``running = (avg_mean, avg_var)`` are updated in place as Chainer does. ``relu``: y is
    ReLU of the normalized output, in the same pass (``fused_relu``).
    """
    m = x.shape[0]
    dtype = x.dtype
    x = np.ascontiguousarray(x)
    mean, var = fused.statistics(x)
    inv_std = np.reciprocal(np.sqrt(var + dtype.type(eps), dtype=dtype))
    normalize = fused_relu.normalize_relu if relu else fused.normalize
    y, x_hat = normalize(x, mean, inv_std, np.ascontiguousarray(gamma), np.ascontiguousarray(beta))
    if running is not None:
        avg_mean, avg_var = running
        adjust = m / max(m - 1., 1.)  # unbiased estimate for the running variance
        avg_mean *= decay
        avg_mean += (1 - decay) * mean
        avg_var *= decay
        avg_var += (1 - decay) * adjust * var
    return y, x_hat, inv_std


def backward(gy, x_hat, gamma, inv_std, beta=None):
    """(M, C) gy and the forward's x_hat -> (gx, ggamma, gbeta).

    gx = gamma * inv_std * (gy - (x_hat * ggamma + gbeta) / M), as
    gy * scale - (x_hat * a + b) with per-channel scale = gamma * inv_std, a = scale * ggamma / M
    and b = scale * gbeta / M. With ``beta`` (a forward with ``relu``), gy is the gradient of the
    ReLU's output: both passes take ReLU's gradient of it on the way (``fused_relu``).
    """
    m = gy.shape[0]
    gy = np.ascontiguousarray(gy)
    gamma = np.ascontiguousarray(gamma)
    if beta is None:
        gbeta, ggamma = fused.grad_sums(gy, x_hat)
    else:
        beta = np.ascontiguousarray(beta)
        gbeta, ggamma = fused_relu.grad_sums_relu(gy, x_hat, gamma, beta)
    scale = np.ascontiguousarray(gamma * inv_std)
    inv_m = gy.dtype.type(1.0 / m)
    a, b = scale * ggamma * inv_m, scale * gbeta * inv_m
    if beta is None:
        gx = fused.grad_x(gy, x_hat, scale, a, b)
    else:
        gx = fused_relu.grad_x_relu(gy, x_hat, gamma, beta, scale, a, b)
    return gx, ggamma, gbeta


def fixed_forward(x, gamma, beta, mean, var, eps: float):
    """Inference BN of (M, C) x with given statistics: y = x * scale + shift."""
    m, c = x.shape
    scale = gamma / np.sqrt(var + x.dtype.type(eps), dtype=x.dtype)
    xw, r = fused.wide(x, c)
    y = np.multiply(xw, np.tile(scale, r))
    y += np.tile(beta - mean * scale, r)
    return y.reshape(m, c)
