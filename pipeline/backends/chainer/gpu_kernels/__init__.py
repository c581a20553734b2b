"""cuDNN kernels for CuPy arrays, chosen per array as ``cpu_kernels`` chooses ours for NumPy ones.

CuPy 14 has no cuDNN binding and Chainer 7 cannot use a later cuDNN, so on a GPU Chainer's
convolutions are im2col + cuBLAS (docs/benchmarks.md, "GPU stage on an H100"). With the
``[cudnn]`` extra (``nvidia-cudnn-frontend``; cuDNN itself comes with ``nvidia-cudnn-cu12/13``)
``Convolution2D`` and ``BatchNormalization`` on float32 CuPy inputs run cuDNN graphs instead
(``graphs``, ``functions``). The switch is the Chainer config entry ``gpu_kernels``
(``"cudnn"``, the default, or ``"chainer"``), defaulting to ``PIPELINE_GPU_KERNELS`` so worker
processes inherit it; without the package, or for a shape cuDNN cannot build, Chainer's
functions run (one log line, never an error).
"""
from __future__ import annotations

import os

import numpy as np

from pipeline.backends.chainer.compat import chainer
from pipeline.backends.chainer.gpu_kernels import functions, graphs

CHOICES = ("cudnn", "chainer")


def default_choice() -> str:
    """``PIPELINE_GPU_KERNELS`` (cudnn | chainer), else "cudnn".

    >>> default_choice() in CHOICES
    True
    """
    choice = os.environ.get("PIPELINE_GPU_KERNELS", "cudnn")
    if choice not in CHOICES:
        raise ValueError(f"PIPELINE_GPU_KERNELS must be one of {CHOICES}, got {choice!r}")
    return choice


def is_cupy(array) -> bool:
    """True for a CuPy ndarray (without importing CuPy).

    >>> is_cupy(np.zeros(1))
    False
    """
    return type(array).__name__ == "ndarray" and type(array).__module__.split(".")[0] == "cupy"


def wanted(x) -> bool:
    """True for a float32 CuPy input (array or Variable) while ``gpu_kernels`` is "cudnn".

    Says nothing about whether cuDNN is there: :func:`use_cudnn` asks that too.
    """
    array = x.array if isinstance(x, chainer.Variable) else x
    choice = getattr(chainer.config, "gpu_kernels", None) or default_choice()
    return is_cupy(array) and array.dtype == np.float32 and choice == "cudnn"


def use_cudnn(x) -> bool:
    """:func:`wanted`, and the cuDNN frontend loads here (tried once per process)."""
    return wanted(x) and graphs.load() is not None


def convolution_2d(x, w, b=None, stride=1, pad=0):
    """``F.convolution_2d`` (dilate 1, groups 1) on cuDNN, or None where cuDNN cannot run it."""
    xa = x.array if isinstance(x, chainer.Variable) else x
    wa = w.array if isinstance(w, chainer.Variable) else w
    if not functions.conv_ready(xa.shape, wa.shape, stride, pad, xa.dtype.name,
                                backward=chainer.config.enable_backprop):
        return None
    inputs = (x, w) if b is None else (x, w, b)
    return functions.Convolution2D(stride, pad).apply(inputs)[0]


def batch_normalization(x, gamma, beta, eps=2e-5, running_mean=None, running_var=None,
                        decay=0.9):
    """``F.batch_normalization`` over axes (0, 2, 3) on cuDNN, or None where it cannot run."""
    xa = x.array if isinstance(x, chainer.Variable) else x
    layout = functions.bn_plan(xa.shape, xa.dtype.name, eps, decay)
    if layout is None:
        return None
    node = functions.BatchNormalization(layout, eps, running_mean, running_var, decay)
    return node.apply((x, gamma, beta))[0]


def fixed_batch_normalization(x, gamma, beta, mean, var, eps=2e-5):
    """``F.fixed_batch_normalization`` on cuDNN without a graph, or None where it cannot run."""
    xa = x.array if isinstance(x, chainer.Variable) else x
    layout = functions.bn_plan(xa.shape, xa.dtype.name, eps, 0.0, ("inference",))
    if layout is None:
        return None
    return functions.FixedBatchNormalization(layout, eps).apply((x, gamma, beta, mean, var))[0]


__all__ = ["CHOICES", "default_choice", "is_cupy", "wanted", "use_cudnn", "convolution_2d",
           "batch_normalization", "fixed_batch_normalization", "graphs", "functions"]
