"""Linear layers on our kernels: ``y = x W^T + b`` and its two gradients, each product cut into fixed pieces of its output that threads share, in fp32 (NumPy's BLAS) or bf16 (oneDNN's matmul).

``F.linear`` (and so ``L.Linear``) runs :class:`Linear` on float32 NumPy inputs with one batch
axis while ``chainer.config.cpu_kernels`` is "ours" (``stock.linear``). Forward ``y = x W^T``,
backward ``gx = gy W`` and ``gW = gy^T x``: each product's output is cut into column pieces (rows
for gW) of at most ``PIECE`` by its shape alone (``pieces``), every piece one GEMM over the whole
sum, and ``chainer.config.cpu_kernel_threads`` threads share the pieces (``sharing``): no
element's sum is split, so the bits are the same at any thread count. One thread runs the same
pieces in turn (a 4096-wide layer: 8 GEMMs of 512 columns, as fast as one of 4096 here).

``cpu_precision`` "bf16": the products' operands rounded to bf16 once (x and W in forward, kept
for backward; gy once for both gradients), each piece one oneDNN matmul (``dnnl_matmul``)
reading its operands in place through strides and summing in float32; the bias, its gradient
(``gy.sum(0)``), y, gx and gW stay float32.

A graph being built during backward (double backprop, ``enable_double_backprop=True``) gets
Chainer's differentiable ``matmul`` and ``sum`` on the float32 operands instead.
"""
from __future__ import annotations

import ctypes

import numpy as np

from pipeline.backends.chainer.compat import chainer
from pipeline.backends.chainer.cpu_kernels import dnnl, onednn, sharing
from pipeline.backends.chainer.cpu_kernels.dnnl import (
    ARG_BIAS, ARG_DST, ARG_SCRATCHPAD, ARG_SRC, ARG_WEIGHTS, BF16, F32, QUERY_IMPL_INFO,
    QUERY_SCRATCHPAD_MD, SCRATCHPAD_USER, _P, _Arg, _Buffer, _check, _dims)

PIECE = 512  # the widest piece of a product's output: columns (y, gx) or rows (gW)


def pieces(n: int) -> list:
    """[lo, hi) ranges cutting an output dimension of ``n`` into pieces of at most ``PIECE``:
    fixed by n alone, so by no thread count.

    >>> pieces(4096)[:2], len(pieces(4096)), pieces(10), pieces(1344)
    ([(0, 512), (512, 1024)], 8, [(0, 10)], [(0, 448), (448, 896), (896, 1344)])
    """
    return sharing.ranges(n, max(1, -(-n // PIECE)))


class Matmul(dnnl.Plan):
    """dst (M, N) float32 = src (M, K) bf16 @ weights (K, N) bf16 [+ bias (1, N) float32], all
    read or written through the element strides in the key."""

    def __init__(self, lib, key):  # noqa: super().__init__ builds a convolution
        self.lib, self._owned = lib, []
        _, m, k, n, src_strides, weights_strides, dst_strides, bias = key
        src = self._strided((m, k), src_strides, BF16)
        weights = self._strided((k, n), weights_strides, BF16)
        dst = self._strided((m, n), dst_strides, F32)
        roles = {ARG_SRC: src, ARG_WEIGHTS: weights, ARG_DST: dst}
        if bias:
            roles[ARG_BIAS] = self._strided((1, n), (n, 1), F32)
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

    def _strided(self, shape, strides, dtype):
        md = _P()
        _check(self.lib.dnnl_memory_desc_create_with_strides(
            ctypes.byref(md), len(shape), _dims(shape), dtype, _dims(strides)), "md")
        self._owned.append(("dnnl_memory_desc_destroy", md))
        return md


def _strides(a: np.ndarray) -> tuple:
    return tuple(s // a.itemsize for s in a.strides)


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray, bias: np.ndarray | None = None):
    """out (M, N) float32 (a view with any strides) = (M, K) @ (K, N) of bf16 bits (uint16;
    views with any element strides) [+ ``bias`` (N,) float32], by this thread's oneDNN matmul."""
    (m, k), n = a.shape, b.shape[1]
    state = dnnl.thread_state()
    key = ("matmul", m, k, n, _strides(a), _strides(b), _strides(out), bias is not None)
    plans = state["plans"]
    if key not in plans:
        while len(plans) >= dnnl.MAX_PLANS:
            del plans[next(iter(plans))]
        plans[key] = Matmul(dnnl._LOAD["lib"], key)
        dnnl.stats["plans"] += 1
        if len(dnnl.impls) < 50:
            dnnl.impls[str(key)] = plans[key].impl
    arrays = {ARG_SRC: a, ARG_WEIGHTS: b, ARG_DST: out}
    if bias is not None:
        arrays[ARG_BIAS] = np.ascontiguousarray(bias, dtype=np.float32)
    plans[key].run(state["stream"], arrays)
    return out


def product(a, b, bf16: bool, by_rows: bool = False, bias=None) -> np.ndarray:
    """a (M, K) @ b (K, N) [+ bias (N,)] as float32 (M, N): the output cut into ``pieces`` of
    its columns (of its rows with ``by_rows``), shared among ``sharing.threads()`` threads.
    ``bf16``: a and b are bf16 bits and each piece is a oneDNN matmul."""
    m, n = a.shape[0], b.shape[1]
    out = np.empty((m, n), np.float32)

    def piece(lo, hi):
        if by_rows:
            pa, pb, po = a[lo:hi], b, out[lo:hi]
        else:
            pa, pb, po = a, b[:, lo:hi], out[:, lo:hi]
        pbias = None if bias is None else bias[lo:hi]
        if bf16:
            matmul(pa, pb, po, pbias)
        else:
            np.matmul(pa, pb, out=po)
            if pbias is not None:
                po += pbias

    sharing.each(piece, pieces(m if by_rows else n))
    return out


class Linear(chainer.FunctionNode):
    """y (N, O) = x (N, K) W (O, K)^T + b (O,), float32 out; products in bf16 where ``bf16``."""

    def __init__(self, bf16: bool = False):
        self.bf16 = bf16

    def forward_cpu(self, inputs):
        self.retain_inputs((0, 1))
        x, w = inputs[:2]
        b = inputs[2] if len(inputs) == 3 else None
        if self.bf16:
            self._x, self._w = onednn.as_bf16(x), onednn.as_bf16(w)
        else:
            self._x, self._w = np.ascontiguousarray(x), np.ascontiguousarray(w)
        bias = None if b is None else np.ascontiguousarray(b, dtype=np.float32)
        return product(self._x, self._w.T, self.bf16, bias=bias),

    def backward(self, indexes, grad_outputs):
        gy = grad_outputs[0]
        if chainer.config.enable_backprop:  # a graph of the gradients: Chainer's functions
            return self._differentiable(indexes, gy)
        g = gy.array
        g_in = onednn.as_bf16(g) if self.bf16 else np.ascontiguousarray(g, dtype=np.float32)
        grads = {}
        if 0 in indexes:
            grads[0] = product(g_in, self._w, self.bf16)
        if 1 in indexes:
            grads[1] = product(g_in.T, self._x, self.bf16, by_rows=True)
        if 2 in indexes:
            grads[2] = g.sum(axis=0)
        return tuple(chainer.Variable(grads[i]) for i in indexes)

    def _differentiable(self, indexes, gy):
        F = chainer.functions
        x, w = self.get_retained_inputs()
        grads = {0: lambda: F.matmul(gy, w), 1: lambda: F.matmul(gy, x, transa=True),
                 2: lambda: F.sum(gy, axis=0)}
        return tuple(grads[i]() for i in indexes)


def usable(x, w, b) -> bool:
    """float32 NumPy operands, and oneDNN loaded for bf16."""
    arrays = [v.array if isinstance(v, chainer.Variable) else v for v in (x, w, b)
              if v is not None]
    return (all(type(a) is np.ndarray and a.dtype == np.float32 for a in arrays)
            and arrays[1].ndim == 2 and (not sharing.bf16() or onednn.load() is not None))


def linear(x, w, b=None):
    """``F.linear`` with one batch axis: x (N, ...) flattened to (N, K) as Chainer does."""
    if x.ndim > 2:
        x = chainer.functions.reshape(x, (x.shape[0], -1))
    inputs = (x, w) if b is None else (x, w, b)
    return Linear(sharing.bf16()).apply(inputs)[0]
