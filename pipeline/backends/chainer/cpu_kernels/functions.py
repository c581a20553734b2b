"""Chainer FunctionNodes around the NumPy kernels: NCHW-shaped Variables in and out, NHWC memory inside.

Every output is an (N, C, H, W) view of C-contiguous (N, H, W, C) memory, and every input is
read through ``to_nhwc``, a free transpose for such a view and one copy for anything else, so a
stack of these functions and elementwise ones passes channels-last memory along untouched.
Backward passes compute only the gradients asked for (the first convolution's input needs none).
First-order gradients only: double backprop raises.
"""
from __future__ import annotations

import numpy as np

from pipeline.backends.chainer.compat import chainer
from pipeline.backends.chainer.cpu_kernels import (convolution, fused, fused_relu,
                                                   normalization, onednn, pooling, sharing)
from pipeline.backends.chainer.cpu_kernels.layout import to_nchw, to_nhwc

type_check = chainer.utils.type_check


def _pair(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def _no_double_backprop(name: str) -> None:
    if chainer.config.enable_backprop:
        raise NotImplementedError(
            f"{name}: the NumPy CPU kernels have no double backprop; use Chainer's functions "
            "(cpu_kernels 'chainer')")


class Convolution2D(chainer.FunctionNode):
    """y = conv(x, W) + b, any stride and padding, dilation 1, one group."""

    def __init__(self, stride=1, pad=0):
        self.stride, self.pad = _pair(stride), _pair(pad)

    def check_type_forward(self, in_types):
        n_in = type_check.eval(in_types.size())
        type_check._argname(in_types, ("x", "W", "b")[:n_in])
        x, w = in_types[0], in_types[1]
        type_check.expect(x.dtype.kind == "f", w.dtype == x.dtype, x.ndim == 4, w.ndim == 4,
                          x.shape[1] == w.shape[1])
        if n_in == 3:
            b = in_types[2]
            type_check.expect(b.dtype == x.dtype, b.ndim == 1, b.shape[0] == w.shape[0])

    def forward_cpu(self, inputs):
        x, w = inputs[:2]
        b = inputs[2] if len(inputs) == 3 else None
        self._bf16 = sharing.bf16()
        y, self._x, self._x_pad = convolution.forward(to_nhwc(x), w, b, self.stride, self.pad,
                                                      sharing.threads(), self._bf16)
        self._x_shape = (x.shape[0], x.shape[2], x.shape[3], x.shape[1])  # NHWC
        self.retain_inputs((1,))
        return to_nchw(y),

    def backward(self, indexes, grad_outputs):
        _no_double_backprop("convolution_2d")
        w = self.get_retained_inputs()[0].array
        gy = to_nhwc(grad_outputs[0].array)
        grads = {}
        if 2 in indexes and 1 not in indexes:  # from the float32 gy, before any rounding
            grads[2] = gy.reshape(-1, gy.shape[-1]).sum(axis=0)
        if self._bf16 and gy.dtype == w.dtype == np.float32:  # rounded once for both passes
            gy = onednn.as_bf16(gy)
        if 0 in indexes:
            grads[0] = to_nchw(convolution.grad_x(gy, w, self._x_shape, self.stride, self.pad,
                                                  sharing.threads(), self._bf16))
        if 1 in indexes:  # the bias gradient comes with it out of the same GEMMs
            grads[1], grads[2] = convolution.grad_w(self._x, gy, *w.shape[2:], self.stride,
                                                    self._x_pad, bias=2 in indexes,
                                                    threads=sharing.threads(), bf16=self._bf16)
        return tuple(chainer.Variable(grads[i]) for i in indexes)


class MaxPooling2D(chainer.FunctionNode):
    """Chainer's max_pooling_2d: padding is -inf, ``cover_all`` adds windows over the edge."""

    def __init__(self, ksize, stride=None, pad=0, cover_all=True):
        self.ksize = _pair(ksize)
        self.stride = self.ksize if stride is None else _pair(stride)
        self.pad, self.cover_all = _pair(pad), cover_all

    def check_type_forward(self, in_types):
        type_check._argname(in_types, ("x",))
        type_check.expect(in_types[0].dtype.kind == "f", in_types[0].ndim == 4)

    def forward_cpu(self, inputs):
        x = to_nhwc(inputs[0])
        # no graph (inference): no backward will come, so skip the argmax bookkeeping
        y, self._state = pooling.max_pool(x, self.ksize, self.stride, self.pad, self.cover_all,
                                          with_arg=chainer.config.enable_backprop,
                                          threads=sharing.threads())
        self._x_shape = x.shape
        return to_nchw(y),

    def backward(self, indexes, grad_outputs):
        _no_double_backprop("max_pooling_2d")
        gx = pooling.max_pool_grad(to_nhwc(grad_outputs[0].array), self._state, self._x_shape,
                                   self.ksize, self.stride, self.pad)
        return chainer.Variable(to_nchw(gx)),


class AveragePooling2D(chainer.FunctionNode):
    """Chainer's average_pooling_2d: no cover_all, padding counted as zeros in every mean."""

    def __init__(self, ksize, stride=None, pad=0):
        self.ksize = _pair(ksize)
        self.stride = self.ksize if stride is None else _pair(stride)
        self.pad = _pair(pad)

    def check_type_forward(self, in_types):
        type_check._argname(in_types, ("x",))
        type_check.expect(in_types[0].dtype.kind == "f", in_types[0].ndim == 4)

    def forward_cpu(self, inputs):
        x = to_nhwc(inputs[0])
        self._x_shape = x.shape
        return to_nchw(pooling.average_pool(x, self.ksize, self.stride, self.pad)),

    def backward(self, indexes, grad_outputs):
        _no_double_backprop("average_pooling_2d")
        gx = pooling.average_pool_grad(to_nhwc(grad_outputs[0].array), self._x_shape,
                                       self.ksize, self.stride, self.pad)
        return chainer.Variable(to_nchw(gx)),


def _pixels(x):
    """(N, C, H, W) of any layout -> ((N*H*W, C) C-contiguous, NHWC shape)."""
    xh = to_nhwc(x)
    return xh.reshape(-1, xh.shape[-1]), xh.shape


class BatchNormalization(chainer.FunctionNode):
    """Training-mode BN over (N, H, W) per channel, updating the running statistics in place."""

    def __init__(self, eps=2e-5, running_mean=None, running_var=None, decay=0.9, relu=False):
        self.eps, self.decay, self.relu = eps, decay, relu
        self.running = None if running_mean is None else (running_mean, running_var)

    def check_type_forward(self, in_types):
        type_check._argname(in_types, ("x", "gamma", "beta"))
        x, gamma, beta = in_types
        type_check.expect(x.dtype.kind == "f", x.ndim == 4, gamma.dtype == x.dtype,
                          beta.dtype == x.dtype, gamma.shape == (x.shape[1],),
                          beta.shape == (x.shape[1],))

    def forward_cpu(self, inputs):
        x, gamma, beta = inputs
        x2, shape = _pixels(x)
        y, self._x_hat, self._inv_std = normalization.forward(x2, gamma, beta, self.eps,
                                                              self.running, self.decay, self.relu)
        self.retain_inputs((1, 2) if self.relu else (1,))
        self._shape = shape
        return to_nchw(y.reshape(shape)),

    def backward(self, indexes, grad_outputs):
        _no_double_backprop("batch_normalization")
        retained = [v.array for v in self.get_retained_inputs()]
        gy, _ = _pixels(grad_outputs[0].array)
        gx, ggamma, gbeta = normalization.backward(gy, self._x_hat, retained[0], self._inv_std,
                                                   retained[1] if self.relu else None)
        grads = {0: to_nchw(gx.reshape(self._shape)), 1: ggamma, 2: gbeta}
        return tuple(chainer.Variable(grads[i]) for i in indexes)


class FixedBatchNormalization(chainer.FunctionNode):
    """Inference BN with given statistics; no backward (used without a graph only)."""

    def __init__(self, eps=2e-5):
        self.eps = eps

    def forward_cpu(self, inputs):
        x, gamma, beta, mean, var = inputs
        x2, shape = _pixels(x)
        return to_nchw(normalization.fixed_forward(x2, gamma, beta, mean, var,
                                                   self.eps).reshape(shape)),

    def backward(self, indexes, grad_outputs):
        raise NotImplementedError("fixed_batch_normalization: NumPy kernel is inference-only")


def batch_normalization(x, gamma, beta, eps=2e-5, running_mean=None, running_var=None,
                        decay=0.9, relu=False):
    """``F.batch_normalization`` for (N, C, H, W) NumPy input (axis (0, 2, 3)); ``relu``:
    ``F.relu`` of it in the same passes (``fused_relu``: the same bits)."""
    return BatchNormalization(eps, running_mean, running_var, decay, relu).apply(
        (x, gamma, beta))[0]


class AddReLU(chainer.FunctionNode):
    """relu(a + b) in one pass; the ReLU's gradient reaches a and b as Add's backward passes it."""

    def forward_cpu(self, inputs):
        self.retain_outputs((0,))
        return fused_relu.add_relu(*inputs),

    def backward(self, indexes, grad_outputs):
        _no_double_backprop("add_relu")
        y = self.get_retained_outputs()[0].array
        g = chainer.Variable(fused.relu_grad(grad_outputs[0].array, y))
        return tuple(g for _ in indexes)


def add_relu(a, b):
    """``F.relu(a + b)`` for NumPy inputs of one shape and dtype, in one pass (the same bits)."""
    return AddReLU().apply((a, b))[0]


def fixed_batch_normalization(x, gamma, beta, mean, var, eps=2e-5):
    """``F.fixed_batch_normalization`` for (N, C, H, W) NumPy input, without a graph."""
    return FixedBatchNormalization(eps).apply((x, gamma, beta, mean, var))[0]


def convolution_2d(x, w, b=None, stride=1, pad=0):
    """Drop-in for ``F.convolution_2d`` (dilate 1, groups 1) on NumPy arrays."""
    inputs = (x, w) if b is None else (x, w, b)
    return Convolution2D(stride, pad).apply(inputs)[0]


def max_pooling_2d(x, ksize, stride=None, pad=0, cover_all=True):
    """Drop-in for ``F.max_pooling_2d`` on NumPy arrays."""
    return MaxPooling2D(ksize, stride, pad, cover_all).apply((x,))[0]


def average_pooling_2d(x, ksize, stride=None, pad=0):
    """Drop-in for ``F.average_pooling_2d`` on NumPy arrays."""
    return AveragePooling2D(ksize, stride, pad).apply((x,))[0]


def spatial_pyramid_pooling_2d(x, pyramid_height: int, pooling: str = "max"):
    """Drop-in for ``F.spatial_pyramid_pooling_2d``: Chainer's levels with our max pooling.

    (N, C, H, W) -> (N, C * sum(4**l), 1, 1), level by level, channel-major within a level.
    """
    if pooling != "max":
        raise ValueError(f"spatial_pyramid_pooling_2d supports pooling 'max' only, got {pooling!r}")
    _, _, h, w = x.shape
    ys = []
    for level in range(pyramid_height):
        bins = 2 ** level
        kh, kw = -(-h // bins), -(-w // bins)
        pad = ((kh * bins - h) // 2, (kw * bins - w) // 2)
        y = max_pooling_2d(x, (kh, kw), None, pad, cover_all=True)
        n, c, yh, yw = y.shape
        ys.append(chainer.functions.reshape(y, (n, c * yh * yw, 1, 1)))
    return chainer.functions.concat(ys)


__all__ = ["Convolution2D", "MaxPooling2D", "AveragePooling2D", "BatchNormalization",
           "FixedBatchNormalization", "convolution_2d", "max_pooling_2d", "average_pooling_2d",
           "spatial_pyramid_pooling_2d", "batch_normalization", "fixed_batch_normalization",
           "AddReLU", "add_relu"]
