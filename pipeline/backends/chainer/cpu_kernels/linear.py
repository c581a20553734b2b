"""Linear layers in bf16: oneDNN's matmul on bf16 inputs with float32 sums, under ``train.precision`` bf16.

``F.linear`` (and so ``L.Linear``) runs :class:`LinearBF16` while ``chainer.config.cpu_precision``
is "bf16" on float32 NumPy inputs (``stock.linear``); else Chainer's own ``linear``, the same
bits as before. Forward ``y = x W^T + b``, backward ``gx = gy W`` and ``gW = gy^T x``: each one
oneDNN matmul (``dnnl_matmul``) on bf16 operands read in place through strides (W^T and gy^T are
views), writing float32; the bias and its gradient stay float32. x and W are rounded once in
forward and kept for backward, gy once for both of its products. One call runs on one OpenMP
thread and is not cut into pieces, so its bits depend on no thread count.
"""
from __future__ import annotations

import ctypes

import numpy as np

from pipeline.backends.chainer.compat import chainer
from pipeline.backends.chainer.cpu_kernels import dnnl, onednn
from pipeline.backends.chainer.cpu_kernels.dnnl import (
    ARG_BIAS, ARG_DST, ARG_SCRATCHPAD, ARG_SRC, ARG_WEIGHTS, BF16, F32, QUERY_IMPL_INFO,
    QUERY_SCRATCHPAD_MD, SCRATCHPAD_USER, _P, _Arg, _Buffer, _check, _dims)

TAG_AB = 3  # dnnl_ab: a plain row-major 2-D memory


class Matmul(dnnl.Plan):
    """dst (M, N) float32 = src (M, K) bf16 @ weights (K, N) bf16 [+ bias (1, N) float32], the
    operands read through the element strides in the key."""

    def __init__(self, lib, key):  # noqa: super().__init__ builds a convolution
        self.lib, self._owned = lib, []
        _, m, k, n, src_strides, weights_strides, bias = key
        src = self._strided((m, k), src_strides)
        weights = self._strided((k, n), weights_strides)
        dst = self._md((m, n), TAG_AB, F32)
        roles = {ARG_SRC: src, ARG_WEIGHTS: weights, ARG_DST: dst}
        if bias:
            roles[ARG_BIAS] = self._md((1, n), TAG_AB, F32)
        attr = _P()
        _check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr")
        self._owned.append(("dnnl_primitive_attr_destroy", attr))
        _check(lib.dnnl_primitive_attr_set_scratchpad_mode(attr, SCRATCHPAD_USER), "scratchpad")
        pd = self._pd(lib.dnnl_matmul_primitive_desc_create, src, weights,
                      roles.get(ARG_BIAS), dst, attr)
        info = ctypes.c_char_p()
        _check(lib.dnnl_primitive_desc_query(pd, QUERY_IMPL_INFO, 0, ctypes.byref(info)), "info")
        self.impl = (info.value or b"?").decode()
        self.prim = self._create(pd)
        self.memories = {arg: self._memory(md) for arg, md in roles.items()}
        args = list(self.memories.items())
        scratch_md = _P(lib.dnnl_primitive_desc_query_md(pd, QUERY_SCRATCHPAD_MD, 0))
        scratch_size = lib.dnnl_memory_desc_get_size(scratch_md) if scratch_md.value else 0
        if scratch_size:
            self.scratch = _Buffer(scratch_size)
            args.append((ARG_SCRATCHPAD, self._memory(scratch_md, self.scratch.ptr)))
        self.args = (_Arg * len(args))(*[_Arg(a, m) for a, m in args])
        self.weights_arg, self.reorder = None, None

    def _strided(self, shape, strides):
        md = _P()
        _check(self.lib.dnnl_memory_desc_create_with_strides(
            ctypes.byref(md), len(shape), _dims(shape), BF16, _dims(strides)), "md")
        self._owned.append(("dnnl_memory_desc_destroy", md))
        return md


def _strides(a: np.ndarray) -> tuple:
    return tuple(s // a.itemsize for s in a.strides)


def matmul(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """(M, K) @ (K, N) of bf16 bits (uint16; views with any element strides) -> float32
    (M, N), plus ``bias`` (N,) float32; by this thread's oneDNN matmul."""
    (m, k), n = a.shape, b.shape[1]
    state = dnnl.thread_state()
    key = ("matmul", m, k, n, _strides(a), _strides(b), bias is not None)
    plans = state["plans"]
    if key not in plans:
        while len(plans) >= dnnl.MAX_PLANS:
            del plans[next(iter(plans))]
        plans[key] = Matmul(dnnl._LOAD["lib"], key)
        dnnl.stats["plans"] += 1
        if len(dnnl.impls) < 50:
            dnnl.impls[str(key)] = plans[key].impl
    out = np.empty((m, n), np.float32)
    arrays = {ARG_SRC: a, ARG_WEIGHTS: b, ARG_DST: out}
    if bias is not None:
        arrays[ARG_BIAS] = np.ascontiguousarray(bias, dtype=np.float32)
    plans[key].run(state["stream"], arrays)
    return out


class LinearBF16(chainer.FunctionNode):
    """y (N, O) = x (N, K) W (O, K)^T + b (O,), products in bf16, sums and outputs float32."""

    def forward_cpu(self, inputs):
        x, w = inputs[:2]
        b = inputs[2] if len(inputs) == 3 else None
        self._x, self._w = onednn.as_bf16(x), onednn.as_bf16(w)
        return matmul(self._x, self._w.T, b),

    def backward(self, indexes, grad_outputs):
        gy = grad_outputs[0].array
        gyb = onednn.as_bf16(gy)
        grads = {}
        if 0 in indexes:
            grads[0] = matmul(gyb, self._w)
        if 1 in indexes:
            grads[1] = matmul(gyb.T, self._x)
        if 2 in indexes:
            grads[2] = gy.sum(axis=0)
        return tuple(chainer.Variable(grads[i]) for i in indexes)


def usable(x, w, b) -> bool:
    """float32 NumPy operands and oneDNN loaded."""
    arrays = [v.array if isinstance(v, chainer.Variable) else v for v in (x, w, b)
              if v is not None]
    return (onednn.load() is not None
            and all(type(a) is np.ndarray and a.dtype == np.float32 for a in arrays))


def linear(x, w, b=None):
    """``F.linear`` with one batch axis, in bf16: x (N, ...) flattened to (N, K) as Chainer does."""
    if x.ndim > 2:
        x = chainer.functions.reshape(x, (x.shape[0], -1))
    inputs = (x, w) if b is None else (x, w, b)
    return LinearBF16().apply(inputs)[0]
