"""Convolutions through oneDNN, the library PyTorch's CPU convolutions run on, called with ctypes.

oneDNN (Intel's deep-learning kernels; Apache 2.0) JIT-compiles convolutions for the CPU it runs
on (AVX2, AVX-512) and packs the windows inside its kernels, where our NumPy path copies im2col
columns and hands them to a BLAS GEMM. It ships as the ``onednn-cpu-gomp`` wheel (a shared
library, ``<prefix>/lib/libdnnl.so.3``, built with GNU OpenMP); this module loads it, builds one
primitive per (pass, shapes, stride, padding) per thread and runs it on our NHWC arrays in place:
activations as oneDNN's ``acdb`` (NHWC) layout, weights reordered into the layout the primitive
asks for (a few KB a layer).

Threads and bits: every call runs oneDNN on one OpenMP thread and cuts the batch into chunks of
images fixed by the batch size alone (``chunks``); ``cpu_kernel_threads`` > 1 deals the chunks
to threads (``sharing``), and the weight gradient sums its chunks' parts in chunk order, so the
result is the same bits at any thread count, as with our NumPy kernels. oneDNN picks its kernel
by the CPU's instruction set, so bits differ between CPUs (as OpenBLAS's do);
``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's own switch) pins one.

Where the library is missing or cannot load (no wheel for the platform, no libgomp), or
``PIPELINE_ONEDNN=0``, :func:`load` says why once and the NumPy kernels run every convolution;
a shape oneDNN cannot build is remembered and left to them too; so are float64 and float16, and
a window that never reaches the input's last rows (oneDNN would need a negative padding).
``PIPELINE_ONEDNN=/path/libdnnl.so.3`` loads that file. The binding itself is ``dnnl``.

Measured (2-core AMD EPYC with AVX-512, one thread, batch 100; docs/benchmarks.md): resnet20's
3x3 convolutions 2.1-2.3x (16 channels) and 1.5-1.6x (32, 64 channels) faster than im2col +
OpenBLAS in each of forward, data gradient and weight gradient; a whole training step 1.51x
(resnet20), 1.28x (cifar10-2015), 1.37x (small-cnn).
"""
from __future__ import annotations

import contextlib

import numpy as np

from pipeline.backends.chainer.cpu_kernels import sharing
from pipeline.backends.chainer.cpu_kernels.dnnl import (  # noqa: F401 (impls ... re-exported)
    ARG_BIAS, ARG_DIFF_BIAS, ARG_DIFF_DST, ARG_DIFF_SRC, ARG_DIFF_WEIGHTS, ARG_DST, ARG_SRC,
    ARG_WEIGHTS, Key, impls, load, plan, round_bf16, stats, thread_state, unavailable_reason,
    version)
from pipeline.backends.chainer.cpu_kernels.bf16 import to_bf16
from pipeline.backends.chainer.cpu_kernels.layout import out_size

_OFF = {"depth": 0}

# Images per chunk: a batch of n is cut into ceil(n / CHUNK_IMAGES) near-equal chunks (100 -> 4
# of 25), enough for two or four threads to share; one thread runs them in turn.
CHUNK_IMAGES = 32


@contextlib.contextmanager
def turned_off():
    """Inside, every convolution takes the im2col + BLAS path (process-wide: benchmarks and tests
    compare the two paths; nest freely, but not from threads that overlap)."""
    _OFF["depth"] += 1
    try:
        yield
    finally:
        _OFF["depth"] -= 1


def pad_right(size: int, k: int, s: int, p: int) -> int:
    """oneDNN's right padding for Chainer's output size (cover_all off): the windows' last
    reach past the input; negative where the last rows are never read.

    >>> pad_right(32, 3, 2, 1), pad_right(32, 3, 1, 1), pad_right(32, 1, 2, 0)
    (0, 1, -1)
    """
    return (out_size(size, k, s, p) - 1) * s + k - size - p


def chunks(n: int) -> list:
    """[lo, hi) image ranges of a batch of ``n``: fixed by n alone, so by no thread count.

    >>> chunks(100), chunks(20)
    ([(0, 25), (25, 50), (50, 75), (75, 100)], [(0, 20)])
    """
    return sharing.ranges(n, max(1, -(-n // CHUNK_IMAGES)))


def usable(dtype, w_shape, stride, pad, hw) -> bool:
    """Whether oneDNN runs this convolution: float32 (or uint16, bf16 bits), the library
    loaded, a right padding oneDNN takes (not negative: a window never reads the input's last
    rows)."""
    if _OFF["depth"] or np.dtype(dtype) not in (np.float32, np.uint16) or load() is None:
        return False
    kh, kw = w_shape[2:]
    return all(pad_right(size, k, s, p) >= 0
               for size, k, s, p in zip(hw, (kh, kw), stride, pad))


def _keys(kind, n_x, x_nhwc_shape, w_shape, stride, pad, bias, bf16):
    _, h, w, c = x_nhwc_shape
    kh, kw = w_shape[2:]
    pad_r = (pad_right(h, kh, stride[0], pad[0]), pad_right(w, kw, stride[1], pad[1]))
    return Key(kind, (n_x, c, h, w), tuple(w_shape), tuple(stride), tuple(pad), pad_r, bias,
               bf16)


ROUND_SLICE = 1 << 18  # values per piece of a rounding that threads share


def as_bf16(a) -> np.ndarray:
    """C-contiguous bf16 bits (uint16) of ``a``: itself where it is already bf16 bits; rounded
    by oneDNN's reorder (``dnnl.round_bf16``: the bits of ``bf16.to_bf16``, 5.7x faster), in
    fixed slices of ``ROUND_SLICE`` values that ``cpu_kernel_threads`` share (element-wise: the
    same bits at any count)."""
    if a.dtype == np.uint16:
        return np.ascontiguousarray(a)
    if a.size == 0 or load() is None:
        return to_bf16(a)
    a = np.ascontiguousarray(a, dtype=np.float32)
    if sharing.threads() == 1 or a.size <= ROUND_SLICE:
        return round_bf16(a)
    out = np.empty(a.shape, np.uint16)
    src, dst = a.reshape(-1), out.reshape(-1)
    sharing.each(lambda lo, hi: round_bf16(src[lo:hi], dst[lo:hi]),
                 sharing.slices(a.size, ROUND_SLICE))
    return out


def _run_chunks(kind, n, x_shape, w_shape, stride, pad, bias, threads, arrays_of,
                bf16=False):
    """Run ``kind`` over the batch's chunks, dealt to ``threads``; ``arrays_of(lo, hi)`` gives
    a chunk's arg -> array. Returns per-chunk results of ``arrays_of``'s second value, in
    chunk order, or None where a plan could not be built (nothing was written then: plans are
    built before any chunk runs)."""
    pieces = chunks(n)

    def share(ranges):
        state = thread_state()
        out = []
        for lo, hi in ranges:
            prepared = plan(_keys(kind, hi - lo, x_shape, w_shape, stride, pad, bias, bf16))
            if prepared is None:
                return None
            arrays, result = arrays_of(lo, hi)
            prepared.run(state["stream"], arrays)
            out.append(result)
        return out

    # the plans first, on this thread (a shape oneDNN refuses leaves the NumPy path a clean start)
    for size in sorted({hi - lo for lo, hi in pieces}):
        if plan(_keys(kind, size, x_shape, w_shape, stride, pad, bias, bf16)) is None:
            return None
    parts = sharing.run(share, sharing.deal(pieces, threads))
    if any(p is None for p in parts):
        return None
    stats["calls"] += 1
    stats["bf16_calls"] += bool(bf16)
    return sharing.in_order(parts)


def forward(x, w, b, stride, pad, threads: int = 1, bf16: bool = False):
    """y (N, Ho, Wo, O) = conv(x (N, H, W, C), w (O, C, kh, kw)) + b, or None (not run).

    ``bf16``: x (float32, or uint16 bf16 bits) and w rounded to bf16, y float32."""
    n, h, wd, _ = x.shape
    o, _, kh, kw = w.shape
    ho, wo = out_size(h, kh, stride[0], pad[0]), out_size(wd, kw, stride[1], pad[1])
    x = as_bf16(x) if bf16 else np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    y = np.empty((n, ho, wo, o), np.float32)
    fixed = {ARG_WEIGHTS: w}
    if b is not None:
        fixed[ARG_BIAS] = np.ascontiguousarray(b, dtype=np.float32)
    done = _run_chunks("forward", n, x.shape, w.shape, stride, pad, b is not None, threads,
                       lambda lo, hi: ({ARG_SRC: x[lo:hi], ARG_DST: y[lo:hi], **fixed}, None),
                       bf16)
    return None if done is None else y


def grad_x(gy, w, x_shape, stride, pad, threads: int = 1, bf16: bool = False):
    """dL/dx (N, H, W, C) float32 from gy (N, Ho, Wo, O), or None (not run).

    ``bf16``: gy (float32, or uint16 bf16 bits) and w rounded to bf16."""
    n = x_shape[0]
    gy = as_bf16(gy) if bf16 else np.ascontiguousarray(gy, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    gx = np.empty(x_shape, np.float32)
    done = _run_chunks("grad_x", n, x_shape, w.shape, stride, pad, False, threads,
                       lambda lo, hi: ({ARG_DIFF_SRC: gx[lo:hi], ARG_WEIGHTS: w,
                                        ARG_DIFF_DST: gy[lo:hi]}, None), bf16)
    return None if done is None else gx


def grad_w(x, gy, w_shape, stride, pad, bias: bool, threads: int = 1, bf16: bool = False):
    """(dL/dw (O, C, kh, kw), dL/db (O,) or None), float32, or None (not run): each chunk's
    parts summed in chunk order. ``bf16``: x and gy (float32 or bf16 bits) as bf16."""
    n = x.shape[0]
    if bf16:
        x, gy = as_bf16(x), as_bf16(gy)
    else:
        x = np.ascontiguousarray(x, dtype=np.float32)
        gy = np.ascontiguousarray(gy, dtype=np.float32)
    o = w_shape[0]

    def arrays_of(lo, hi):
        gw = np.empty(w_shape, np.float32)
        gb = np.empty(o, np.float32) if bias else None
        arrays = {ARG_SRC: x[lo:hi], ARG_DIFF_WEIGHTS: gw, ARG_DIFF_DST: gy[lo:hi]}
        if bias:
            arrays[ARG_DIFF_BIAS] = gb
        return arrays, (gw, gb)

    parts = _run_chunks("grad_w", n, x.shape, w_shape, stride, pad, bias, threads, arrays_of,
                        bf16)
    if parts is None:
        return None
    gw, gb = parts[0]
    for pw, pb in parts[1:]:
        gw += pw
        if bias:
            gb += pb
    return gw, gb
