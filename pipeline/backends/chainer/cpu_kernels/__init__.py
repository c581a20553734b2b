"""Fast CPU kernels for the layers our models use, chosen per array: ours on NumPy, cuDNN on CuPy, else Chainer's.

``Convolution2D`` and ``BatchNormalization`` (Chainer's Links, same parameters and paths) and
the pooling functions below run the pure-NumPy FunctionNodes of ``cpu_kernels.functions`` when
the input is a NumPy array and ``chainer.config.cpu_kernels`` is ``"ours"`` (the default). On
float32 CuPy arrays the two Links run cuDNN graphs (``pipeline.backends.chainer.gpu_kernels``)
while ``chainer.config.gpu_kernels`` is ``"cudnn"`` and the cuDNN frontend is installed; anything
else (ChainerX/iDeep arrays, ``"chainer"``, a shape cuDNN cannot run) goes to Chainer's own
functions. The switches are Chainer config entries, like Chainer's own ``use_cudnn``/``use_ideep``:
a task sets ``chainer.using_config("cpu_kernels", spec.cpu_kernels)``. A third,
``cpu_kernel_threads`` (default 1), shares each convolution's im2col chunks, max pooling's
images and Adam's slices among that many threads (``cpu_kernels.sharing``; the backend sets it
from a task's threads); with BLAS at one thread the result is the same bits as with one.

>>> import numpy as np
>>> x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
>>> max_pooling_2d(x, 2).array[0, 0]
array([[ 5.,  7.],
       [13., 15.]], dtype=float32)
"""
from __future__ import annotations

import numpy as np

from pipeline.backends.chainer.compat import F, L, chainer
from pipeline.backends.chainer import gpu_kernels
from pipeline.backends.chainer.cpu_kernels import functions

def use_ours(x) -> bool:
    """True for a NumPy input (array or Variable) while ``chainer.config.cpu_kernels`` is "ours"."""
    array = x.array if isinstance(x, chainer.Variable) else x
    return type(array) is np.ndarray and getattr(chainer.config, "cpu_kernels", "ours") == "ours"


class Convolution2D(L.Convolution2D):
    """``L.Convolution2D`` that runs our kernel on NumPy inputs (same parameters, same paths)."""

    def forward(self, x):
        if (self.W.array is None or self.dilate != (1, 1) or self.groups != 1
                or self.W.dtype != x.dtype or (self.b is not None and self.b.dtype != x.dtype)):
            return super().forward(x)
        if use_ours(x):
            return functions.convolution_2d(x, self.W, self.b, self.stride, self.pad)
        if gpu_kernels.use_cudnn(x):
            y = gpu_kernels.convolution_2d(x, self.W, self.b, self.stride, self.pad)
            if y is not None:
                return y
        return super().forward(x)


class BatchNormalization(L.BatchNormalization):
    """``L.BatchNormalization`` that runs our kernel on 4-D NumPy inputs over axes (0, 2, 3).

    Training mode uses batch statistics and updates ``avg_mean``/``avg_var`` as Chainer does;
    inference without a graph uses them. Fine-tuning, recomputation, other axes and
    inference with a graph go to Chainer's functions.
    """

    def forward(self, x, relu: bool = False, **kwargs):
        """BN of x; ``relu``: ``F.relu`` of it, in the same passes on our kernels (the same
        bits: ``cpu_kernels.fused_relu``), after it elsewhere."""
        if (kwargs or x.ndim != 4 or self.axis is not None
                or self.avg_mean is None or self.gamma is None or self.beta is None
                or self.gamma.dtype != x.dtype or chainer.config.in_recomputing):
            return _relu_if(super().forward(x, **kwargs), relu)
        if use_ours(x):
            return self._ours(x, relu)
        if gpu_kernels.use_cudnn(x):
            y = self._cudnn(x)
            if y is not None:
                return _relu_if(y, relu)
        return _relu_if(super().forward(x), relu)

    def _cudnn(self, x):
        if chainer.config.train:
            return gpu_kernels.batch_normalization(x, self.gamma, self.beta, self.eps,
                                                   self.avg_mean, self.avg_var, self.decay)
        if not chainer.config.enable_backprop:
            return gpu_kernels.fixed_batch_normalization(x, self.gamma, self.beta,
                                                         self.avg_mean, self.avg_var, self.eps)
        return None

    def _ours(self, x, relu: bool = False):
        if chainer.config.train:
            return functions.batch_normalization(x, self.gamma, self.beta, self.eps,
                                                 self.avg_mean, self.avg_var, self.decay, relu)
        if not chainer.config.enable_backprop:
            return _relu_if(functions.fixed_batch_normalization(
                x, self.gamma, self.beta, self.avg_mean, self.avg_var, self.eps), relu)
        return _relu_if(super().forward(x), relu)


def _relu_if(y, relu: bool):
    return F.relu(y) if relu else y


def add_relu(a, b):
    """``F.relu(a + b)``: one pass on our kernels for NumPy inputs of one shape and dtype (the
    same bits, ``cpu_kernels.fused_relu``), Chainer's two functions elsewhere."""
    arrays = [v.array if isinstance(v, chainer.Variable) else v for v in (a, b)]
    if (use_ours(a) and type(arrays[1]) is np.ndarray and arrays[0].shape == arrays[1].shape
            and arrays[0].dtype == arrays[1].dtype and arrays[0].dtype.kind == "f"):
        return functions.add_relu(a, b)
    return F.relu(a + b)


def max_pooling_2d(x, ksize, stride=None, pad=0, cover_all=True):
    """``F.max_pooling_2d`` (no ``return_indices``)."""
    if use_ours(x):
        return functions.max_pooling_2d(x, ksize, stride, pad, cover_all)
    return F.max_pooling_2d(x, ksize, stride, pad, cover_all)


def average_pooling_2d(x, ksize, stride=None, pad=0):
    """``F.average_pooling_2d``."""
    if use_ours(x):
        return functions.average_pooling_2d(x, ksize, stride, pad)
    return F.average_pooling_2d(x, ksize, stride, pad)


def spatial_pyramid_pooling_2d(x, pyramid_height: int, pooling: str = "max"):
    """``F.spatial_pyramid_pooling_2d``."""
    if use_ours(x):
        return functions.spatial_pyramid_pooling_2d(x, pyramid_height, pooling)
    return F.spatial_pyramid_pooling_2d(x, pyramid_height, pooling)


__all__ = ["use_ours", "Convolution2D", "BatchNormalization", "max_pooling_2d",
           "average_pooling_2d", "spatial_pyramid_pooling_2d", "add_relu"]
