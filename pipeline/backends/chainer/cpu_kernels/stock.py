"""Chainer's stock functions on our kernels: ``install()`` points ``F.convolution_2d`` and friends at dispatchers.

A user's model written with Chainer's own links and functions (``L.Convolution2D``,
``L.BatchNormalization``, ``F.max_pooling_2d``, ...) never calls our wrappers, so ``install()``
replaces Chainer's function-level entry points, in ``chainer.functions`` and in the modules the
links call through (``L.Convolution2D`` calls ``chainer.functions.connection.convolution_2d``'s
``convolution_2d``; ``L.BatchNormalization`` calls ``chainer.functions.batch_normalization``).
Each dispatcher runs our FunctionNode when the arguments are what our kernels do exactly as
Chainer does (a NumPy float32/float64 input, ``chainer.config.cpu_kernels == "ours"``, Chainer's
default memory layout, dilation 1, one group, no ``cover_all`` convolution, no
``return_indices``, ...) and Chainer's own function otherwise, with the same arguments. Our
own nets call ``cpu_kernels.functions`` directly, so installing changes none of their bits.
``install()`` also puts ``cpu_kernels.optimizers``' Adam update (the same bits, by slices) on
Chainer's ``AdamRule`` and ``cpu_kernels.activations``' ReLU gradient (the same bits, one pass)
on Chainer's ``ReLUGrad2``.

What a stock net gives up on our kernels: double backprop (our FunctionNodes raise; set
``cpu_kernels`` to ``"chainer"``), and Chainer's ``FixedBatchNormalization`` runs whenever a
graph is being built (our inference BN has no backward).

>>> install(); install()  # idempotent
>>> import numpy as np
>>> x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
>>> type(chainer.functions.max_pooling_2d(x, 2).creator).__module__.endswith("cpu_kernels.functions")
True
>>> with chainer.using_config("cpu_kernels", "chainer"):
...     type(chainer.functions.max_pooling_2d(x, 2).creator).__name__
'MaxPoolingND'
"""
from __future__ import annotations

import importlib
import threading

import numpy as np

from pipeline.backends.chainer.compat import chainer
from pipeline.backends.chainer.cpu_kernels import (activations, functions, optimizers,
                                                   use_ours)
from pipeline.backends.chainer.cpu_kernels import linear as our_linear

# name -> the modules whose attribute of that name Chainer's links or users call through
_HOMES = {
    "convolution_2d": ("chainer.functions", "chainer.functions.connection.convolution_2d"),
    "batch_normalization": ("chainer.functions",
                            "chainer.functions.normalization.batch_normalization"),
    "fixed_batch_normalization": ("chainer.functions",
                                  "chainer.functions.normalization.batch_normalization"),
    "max_pooling_2d": ("chainer.functions", "chainer.functions.pooling.max_pooling_nd"),
    "average_pooling_2d": ("chainer.functions", "chainer.functions.pooling.average_pooling_2d"),
    "spatial_pyramid_pooling_2d": ("chainer.functions",
                                   "chainer.functions.pooling.spatial_pyramid_pooling_2d"),
    "linear": ("chainer.functions", "chainer.functions.connection.linear"),
}
# Chainer's own functions, taken from their defining modules before anything is replaced
ORIGINAL = {name: getattr(importlib.import_module(homes[1]), name)
            for name, homes in _HOMES.items()}
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_LOCK = threading.Lock()


def _array(v):
    return v.array if isinstance(v, chainer.Variable) else v


def _plain(x, *others) -> bool:
    """x: a 4-D NumPy float32/float64 input in Chainer's default layout, our kernels enabled;
    ``others`` (arrays, Variables or None) of x's dtype."""
    if not use_ours(x) or getattr(x, "layout", None) is not None:
        return False
    a = _array(x)
    return (a.ndim == 4 and a.dtype in _FLOATS
            and all(v is None or _array(v).dtype == a.dtype for v in others))


def _pair(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def convolution_2d(x, W, b=None, stride=1, pad=0, cover_all=False, **kwargs):
    """``F.convolution_2d``: ours for dilate 1, groups 1 and no ``cover_all``."""
    if (_plain(x, W, b) and not cover_all and set(kwargs) <= {"dilate", "groups", "cudnn_fast"}
            and _pair(kwargs.get("dilate", 1)) == (1, 1) and kwargs.get("groups", 1) == 1):
        return functions.convolution_2d(x, W, b, stride, pad)
    return ORIGINAL["convolution_2d"](x, W, b, stride, pad, cover_all, **kwargs)


def batch_normalization(x, gamma, beta, **kwargs):
    """``F.batch_normalization``: ours over axes (0, 2, 3) of a 4-D input, Chainer's in recomputation."""
    axis = kwargs.get("axis")
    running = (kwargs.get("running_mean"), kwargs.get("running_var"))
    if (_plain(x, gamma, beta) and set(kwargs) <= {"eps", "running_mean", "running_var",
                                                  "decay", "axis"}
            and (axis is None or tuple(axis) == (0, 2, 3)) and _array(gamma).ndim == 1
            and not chainer.config.in_recomputing
            and (running[0] is running[1] is None or all(type(r) is np.ndarray
                                                and r.dtype == _array(x).dtype
                                                for r in running))):
        return functions.batch_normalization(x, gamma, beta, kwargs.get("eps", 2e-5), *running,
                                             kwargs.get("decay", 0.9))
    return ORIGINAL["batch_normalization"](x, gamma, beta, **kwargs)


def fixed_batch_normalization(x, gamma, beta, mean, var, eps=2e-5, axis=None):
    """``F.fixed_batch_normalization``: ours without a graph (inference), Chainer's with one."""
    if (_plain(x, gamma, beta, mean, var) and not chainer.config.enable_backprop
            and (axis is None or tuple(axis) == (0, 2, 3)) and _array(gamma).ndim == 1):
        return functions.fixed_batch_normalization(x, gamma, beta, mean, var, eps)
    return ORIGINAL["fixed_batch_normalization"](x, gamma, beta, mean, var, eps, axis)


def max_pooling_2d(x, ksize, stride=None, pad=0, cover_all=True, return_indices=False):
    """``F.max_pooling_2d``: ours unless ``return_indices``."""
    if _plain(x) and not return_indices:
        return functions.max_pooling_2d(x, ksize, stride, pad, cover_all)
    return ORIGINAL["max_pooling_2d"](x, ksize, stride, pad, cover_all, return_indices)


def average_pooling_2d(x, ksize, stride=None, pad=0):
    """``F.average_pooling_2d``."""
    if _plain(x):
        return functions.average_pooling_2d(x, ksize, stride, pad)
    return ORIGINAL["average_pooling_2d"](x, ksize, stride, pad)


def spatial_pyramid_pooling_2d(x, pyramid_height, pooling=None):
    """``F.spatial_pyramid_pooling_2d``: ours for ``pooling="max"``."""
    if _plain(x) and pooling == "max":
        return functions.spatial_pyramid_pooling_2d(x, pyramid_height, pooling)
    return ORIGINAL["spatial_pyramid_pooling_2d"](x, pyramid_height, pooling)


def linear(x, W, b=None, n_batch_axes=1):
    """``F.linear``: ours (``cpu_kernels.linear``: products in fixed pieces threads share; bf16
    under ``cpu_precision`` bf16) for one batch axis and float32 NumPy operands, else Chainer's."""
    if n_batch_axes == 1 and use_ours(x) and our_linear.usable(x, W, b):
        return our_linear.linear(x, W, b)
    return ORIGINAL["linear"](x, W, b, n_batch_axes)


DISPATCHERS = {name: globals()[name] for name in _HOMES}


def _point(functions: dict) -> None:
    """Set each of Chainer's entry points (every module it is reached through) to ``functions``."""
    for name, homes in _HOMES.items():
        for home in homes:
            setattr(importlib.import_module(home), name, functions[name])


def install() -> None:
    """Point Chainer's entry points at the dispatchers (once per process; idempotent, thread-safe)."""
    with _LOCK:
        _point(DISPATCHERS)
        optimizers.install()
        activations.install()


def uninstall() -> None:
    """Give Chainer its own functions back (tests)."""
    with _LOCK:
        _point(ORIGINAL)
        optimizers.uninstall()
        activations.uninstall()


def installed() -> bool:
    return chainer.functions.convolution_2d is DISPATCHERS["convolution_2d"]
