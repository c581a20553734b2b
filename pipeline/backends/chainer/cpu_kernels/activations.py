"""Chainer's ReLU and its gradient on our kernels: ``install()`` puts ``fused.relu`` and ``fused.relu_grad``
(one compiled pass each, the same bits, slices shared among ``cpu_kernel_threads``) on
``ReLU.forward_cpu`` and ``ReLUGrad2.forward_cpu``.

``F.relu``'s backward is ``ReLUGrad2(y)``, whose CPU forward is ``gy * (y > 0)``: a comparison
pass, a cast of the mask and a multiplication. Ours computes the same product per element in
one loop where the inputs are NumPy arrays of one dense layout and ``chainer.config.cpu_kernels``
is ``"ours"``; anything else (iDeep, other layouts, ``"chainer"``) runs Chainer's. The node and
its double backprop stay Chainer's.
"""
from __future__ import annotations

import numpy as np

from pipeline.backends.chainer.compat import chainer
from pipeline.backends.chainer.cpu_kernels import fused, use_ours

_relu = chainer.functions.activation.relu
ORIGINAL = _relu.ReLUGrad2.forward_cpu
ORIGINAL_FORWARD = _relu.ReLU.forward_cpu


def relu_forward_cpu(node, inputs):
    """``ReLU.forward_cpu``: ours (``fused.relu``, the same bits) for a NumPy float input."""
    x, = inputs
    if (type(x) is np.ndarray and use_ours(x) and x.dtype.kind == "f"
            and not chainer.backends.intel64.should_use_ideep(">=auto")):
        node.retain_outputs((0,))
        return fused.relu(x),
    return ORIGINAL_FORWARD(node, inputs)


def relu_grad_forward_cpu(node, inputs):
    """``ReLUGrad2.forward_cpu``: ours for a NumPy gy and y of its dtype."""
    gy, = inputs
    y = node.b
    if (type(gy) is np.ndarray and type(y) is np.ndarray and use_ours(gy)
            and gy.dtype == y.dtype and gy.shape == y.shape
            and not chainer.backends.intel64.should_use_ideep(">=auto")):
        return fused.relu_grad(gy, y),
    return ORIGINAL(node, inputs)


def install() -> None:
    _relu.ReLUGrad2.forward_cpu = relu_grad_forward_cpu
    _relu.ReLU.forward_cpu = relu_forward_cpu


def uninstall() -> None:
    _relu.ReLUGrad2.forward_cpu = ORIGINAL
    _relu.ReLU.forward_cpu = ORIGINAL_FORWARD
