"""oneDNN's C API by ctypes: the library loaded once, one convolution primitive per key and thread.

The binding ``cpu_kernels.onednn`` runs convolutions on: where ``pip install onednn-cpu-gomp``
put ``libdnnl.so.3`` (the environment's ``lib/``), the system's, or ``PIPELINE_ONEDNN=<path>``;
``PIPELINE_ONEDNN=0`` turns it off. A plan (:class:`Plan`) holds a primitive, its memory objects
pointed at the caller's arrays on each run, the weights reorder between our plain OIHW and the
layout the primitive chose, and a user scratchpad, so plans of one thread never share state; each
thread runs oneDNN on one OpenMP thread (``omp_set_num_threads(1)`` before each convolution).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import site
import sys
import sysconfig
import threading
from typing import NamedTuple

import numpy as np

from pipeline.backends.chainer.cpu_kernels.layout import out_size
from pipeline.core.errors import one_line

log = logging.getLogger("pipeline.cpu_kernels")

# The values of oneDNN 3's C API (oneapi/dnnl/dnnl_types.h, dnnl_config.h); a library whose
# major version is not 3 is not loaded.
BF16, F32 = 2, 3
TAG_ANY, TAG_A, TAG_ABCD, TAG_ACDB = 1, 2, 5, 22
FORWARD_TRAINING, BACKWARD_DATA, BACKWARD_WEIGHTS = 64, 160, 192
CONVOLUTION_DIRECT = 1
ENGINE_CPU = 1
STREAM_IN_ORDER = 1
SCRATCHPAD_USER = 1
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_BIAS = 1, 17, 33, 41
ARG_DIFF_SRC, ARG_DIFF_DST, ARG_DIFF_WEIGHTS, ARG_DIFF_BIAS = 129, 145, 161, 169
ARG_SCRATCHPAD = 80
QUERY_IMPL_INFO, QUERY_WEIGHTS_MD, QUERY_DIFF_WEIGHTS_MD, QUERY_SCRATCHPAD_MD = 8, 131, 132, 136
RUNTIME_OMP = 2

_P = ctypes.c_void_p
_Dims = ctypes.c_int64 * 12


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _P)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


_LOAD = {"tried": False, "lib": None, "reason": None, "version": None, "omp": None,
         "engine": None}
_LOAD_LOCK = threading.Lock()
_local = threading.local()
# per process, read by tests and benchmarks ("bf16_calls": the calls of them in bf16)
stats = {"plans": 0, "unsupported": 0, "calls": 0, "bf16_calls": 0}
impls: dict = {}  # str(key) -> the implementation oneDNN chose ("brgconv:avx512_core"), first 50


# ------------------------------------------------------------------------------------ loading
def _candidates() -> list[str]:
    """Where ``pip install onednn-cpu-gomp`` puts the library (its data files go to the
    environment's prefix, not site-packages), then the system's."""
    names = []
    for base in (sys.prefix, sysconfig.get_path("data"), site.getuserbase()):
        path = os.path.join(base or "", "lib", "libdnnl.so.3")
        if base and path not in names and os.path.exists(path):
            names.append(path)
    found = ctypes.util.find_library("dnnl")
    if found:
        names.append(found)
    return names


def _declare(lib) -> None:
    lib.dnnl_version.restype = ctypes.POINTER(_Version)
    lib.dnnl_primitive_desc_query_md.restype = _P
    lib.dnnl_primitive_desc_query_md.argtypes = [_P, ctypes.c_int, ctypes.c_int]
    lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
    lib.dnnl_memory_desc_get_size.argtypes = [_P]
    lib.dnnl_memory_desc_equal.argtypes = [_P, _P]
    lib.dnnl_memory_set_data_handle.argtypes = [_P, _P]
    lib.dnnl_primitive_execute.argtypes = [_P, _P, ctypes.c_int, _P]
    lib.dnnl_stream_wait.argtypes = [_P]


def _omp_set_num_threads():
    """The OpenMP runtime's ``omp_set_num_threads`` (libdnnl's libgomp), or None."""
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so"):
        try:
            return ctypes.CDLL(name).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def load():
    """The loaded library (ctypes), or None: the reason is in :func:`unavailable_reason`."""
    if _LOAD["tried"]:
        return _LOAD["lib"]
    with _LOAD_LOCK:
        if not _LOAD["tried"]:
            try:
                _LOAD["lib"] = _load()
            except Exception as exc:  # OSError from dlopen, our own RuntimeErrors below
                _LOAD["reason"] = one_line(exc, limit=240)
                log.info("oneDNN convolutions unavailable (%s); im2col + BLAS runs them",
                         _LOAD["reason"])
            _LOAD["tried"] = True
    return _LOAD["lib"]


def _load():
    setting = os.environ.get("PIPELINE_ONEDNN", "").strip()
    if setting.lower() in ("0", "off", "false", "no"):
        raise RuntimeError(f"PIPELINE_ONEDNN={setting}")
    paths = [setting] if setting and setting.lower() not in ("1", "on") else _candidates()
    if not paths:
        raise RuntimeError("no libdnnl.so.3 (pip install onednn-cpu-gomp)")
    lib = ctypes.CDLL(paths[0])
    _declare(lib)
    version = lib.dnnl_version().contents
    if version.major != 3:
        raise RuntimeError(f"{paths[0]} is oneDNN {version.major}.{version.minor}, not 3.x")
    omp = _omp_set_num_threads() if version.cpu_runtime == RUNTIME_OMP else None
    if version.cpu_runtime == RUNTIME_OMP and omp is None:
        raise RuntimeError("oneDNN runs on OpenMP but omp_set_num_threads was not found")
    engine = _P()
    _check(lib.dnnl_engine_create(ctypes.byref(engine), ENGINE_CPU, ctypes.c_size_t(0)),
           "engine")
    _LOAD.update(version=f"{version.major}.{version.minor}.{version.patch}", omp=omp,
                 engine=engine)
    log.info("oneDNN %s from %s", _LOAD["version"], paths[0])
    return lib


def unavailable_reason() -> str | None:
    return _LOAD["reason"]


def version() -> str | None:
    return _LOAD["version"] if load() is not None else None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"oneDNN {what}: status {status}")


# ------------------------------------------------------------------------------------- plans
class Key(NamedTuple):
    """One primitive: the pass, NCHW dims of x, w's shape, stride, both paddings, bias."""
    kind: str  # forward | grad_x | grad_w
    x: tuple
    w: tuple
    stride: tuple
    pad_l: tuple
    pad_r: tuple
    bias: bool
    bf16: bool = False  # src, weights and dst/diff_dst in bf16; dst, diff_src, diff_weights
    #                     and bias f32 (oneDNN sums the products in f32 either way)


def thread_state():
    """This thread's stream and plans, its OpenMP runtime set to one thread.

    Set on every call, not once per thread: the setting is the calling thread's own, and others
    change it. threadpoolctl (``core.threads.limit_blas_threads``) restores the limits the first
    task in found from whichever thread leaves last, and a worker thread whose oneDNN had been
    pinned then ran its convolutions on 2 OpenMP threads: other bits (a test of replicas as
    threads failed now and then after an earlier run had loaded libgomp). One ctypes call."""
    if _LOAD["omp"] is not None:
        _LOAD["omp"](1)
    state = getattr(_local, "state", None)
    if state is None:
        lib = _LOAD["lib"]
        stream = _P()
        _check(lib.dnnl_stream_create(ctypes.byref(stream), _LOAD["engine"], STREAM_IN_ORDER),
               "stream")
        state = _local.state = {"stream": stream, "plans": {}}
    return state


def _dims(values) -> _Dims:
    d = _Dims()
    for i, v in enumerate(values):
        d[i] = int(v)
    return d


class _Buffer:
    """A 64-byte aligned uint8 buffer of ``size`` bytes (oneDNN's blocked weights, scratchpad)."""

    def __init__(self, size: int):
        self.raw = np.empty(max(size, 1) + 64, np.uint8)
        start = (-self.raw.ctypes.data) % 64
        self.array = self.raw[start:start + max(size, 1)]
        self.ptr = self.array.ctypes.data


class Plan:
    """One primitive with its memory objects, its weights reorder and its scratchpad."""

    def __init__(self, lib, key: Key):
        self.lib = lib
        self._owned = []  # (destroy function name, handle)
        n, c, h, w = key.x
        o, _, kh, kw = key.w
        ho = out_size(h, kh, key.stride[0], key.pad_l[0])
        wo = out_size(w, kw, key.stride[1], key.pad_l[1])
        low = BF16 if key.bf16 else F32  # the convolution's inputs
        src = self._md((n, c, h, w), TAG_ACDB, low if key.kind != "grad_x" else F32)
        dst = self._md((n, o, ho, wo), TAG_ACDB, F32 if key.kind == "forward" else low)
        # our weights stay f32 (plain OIHW): a bf16 primitive reads them through the reorder,
        # which rounds them to bf16 (nearest, ties to even); grad_w writes f32 ones
        plain_w = self._md(key.w, TAG_ABCD)
        any_w = self._md(key.w, TAG_ANY, low if key.kind != "grad_w" else F32)
        bias = self._md((o,), TAG_A) if key.bias else None
        attr = _P()
        _check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr")
        self._owned.append(("dnnl_primitive_attr_destroy", attr))
        _check(lib.dnnl_primitive_attr_set_scratchpad_mode(attr, SCRATCHPAD_USER), "scratchpad")
        geometry = (_dims(key.stride), _dims((0, 0)), _dims(key.pad_l), _dims(key.pad_r))
        hint = (src, any_w, dst) if not key.bf16 or key.kind == "forward" else (
            self._md((n, c, h, w), TAG_ACDB, low), self._md(key.w, TAG_ANY, low), dst)
        forward = self._pd(lib.dnnl_convolution_forward_primitive_desc_create,
                           FORWARD_TRAINING, CONVOLUTION_DIRECT, hint[0], hint[1], bias,
                           hint[2], *geometry, attr)
        if key.kind == "forward":
            pd = forward
            roles = {ARG_SRC: src, ARG_WEIGHTS: None, ARG_DST: dst}
            if key.bias:
                roles[ARG_BIAS] = bias
            weights_query, weights_arg = QUERY_WEIGHTS_MD, ARG_WEIGHTS
        elif key.kind == "grad_x":
            pd = self._pd(lib.dnnl_convolution_backward_data_primitive_desc_create,
                          CONVOLUTION_DIRECT, src, any_w, dst, *geometry, forward, attr)
            roles = {ARG_DIFF_SRC: src, ARG_WEIGHTS: None, ARG_DIFF_DST: dst}
            weights_query, weights_arg = QUERY_WEIGHTS_MD, ARG_WEIGHTS
        else:
            pd = self._pd(lib.dnnl_convolution_backward_weights_primitive_desc_create,
                          CONVOLUTION_DIRECT, src, any_w, bias, dst, *geometry, forward, attr)
            roles = {ARG_SRC: src, ARG_DIFF_WEIGHTS: None, ARG_DIFF_DST: dst}
            if key.bias:
                roles[ARG_DIFF_BIAS] = bias
            weights_query, weights_arg = QUERY_DIFF_WEIGHTS_MD, ARG_DIFF_WEIGHTS
        info = ctypes.c_char_p()
        _check(lib.dnnl_primitive_desc_query(pd, QUERY_IMPL_INFO, 0, ctypes.byref(info)), "info")
        self.impl = (info.value or b"?").decode()
        self.prim = self._create(pd)
        chosen = _P(lib.dnnl_primitive_desc_query_md(pd, weights_query, 0))
        roles[weights_arg] = chosen
        # weights in the primitive's layout: ours (plain OIHW) reordered in or out
        self.reorder = None
        if not lib.dnnl_memory_desc_equal(chosen, plain_w):
            source, target = (plain_w, chosen) if key.kind != "grad_w" else (chosen, plain_w)
            reorder_pd = _P()
            _check(lib.dnnl_reorder_primitive_desc_create(ctypes.byref(reorder_pd), source,
                                                          _LOAD["engine"], target,
                                                          _LOAD["engine"], None), "reorder")
            self._owned.append(("dnnl_primitive_desc_destroy", reorder_pd))
            self.reorder = self._create(reorder_pd)
            self.blocked = _Buffer(lib.dnnl_memory_desc_get_size(chosen))
            self.plain_mem = self._memory(plain_w)
            self.blocked_mem = self._memory(chosen, self.blocked.ptr)
            self.reorder_args = (_Arg * 2)(
                _Arg(ARG_SRC, self.plain_mem if key.kind != "grad_w" else self.blocked_mem),
                _Arg(ARG_DST, self.blocked_mem if key.kind != "grad_w" else self.plain_mem))
        scratch_md = _P(lib.dnnl_primitive_desc_query_md(pd, QUERY_SCRATCHPAD_MD, 0))
        scratch_size = lib.dnnl_memory_desc_get_size(scratch_md) if scratch_md.value else 0
        self.memories = {arg: self._memory(md) for arg, md in roles.items()}
        if self.reorder is not None:  # the primitive reads/writes the blocked buffer
            _check(lib.dnnl_memory_set_data_handle(self.memories[weights_arg], self.blocked.ptr),
                   "handle")
        self.weights_arg = weights_arg
        args = list(self.memories.items())
        if scratch_size:
            self.scratch = _Buffer(scratch_size)
            args.append((ARG_SCRATCHPAD, self._memory(scratch_md, self.scratch.ptr)))
        self.args = (_Arg * len(args))(*[_Arg(a, m) for a, m in args])

    def _md(self, shape, tag, dtype=F32):
        md = _P()
        _check(self.lib.dnnl_memory_desc_create_with_tag(ctypes.byref(md), len(shape),
                                                         _dims(shape), dtype, tag), "md")
        self._owned.append(("dnnl_memory_desc_destroy", md))
        return md

    def _pd(self, create, *args):
        pd = _P()
        _check(create(ctypes.byref(pd), _LOAD["engine"], *args), "primitive descriptor")
        self._owned.append(("dnnl_primitive_desc_destroy", pd))
        return pd

    def _create(self, pd):
        prim = _P()
        _check(self.lib.dnnl_primitive_create(ctypes.byref(prim), pd), "primitive")
        self._owned.append(("dnnl_primitive_destroy", prim))
        return prim

    def _memory(self, md, ptr=None):
        mem = _P()
        _check(self.lib.dnnl_memory_create(ctypes.byref(mem), md, _LOAD["engine"], _P(ptr)),
               "memory")
        self._owned.append(("dnnl_memory_destroy", mem))
        return mem

    def run(self, stream, arrays: dict) -> None:
        """Point the memory objects at ``arrays`` (arg -> C-contiguous ndarray) and execute."""
        lib = self.lib
        for arg, array in arrays.items():
            if arg == self.weights_arg and self.reorder is not None:
                _check(lib.dnnl_memory_set_data_handle(self.plain_mem, array.ctypes.data),
                       "handle")
            else:
                _check(lib.dnnl_memory_set_data_handle(self.memories[arg], array.ctypes.data),
                       "handle")
        if self.reorder is not None and self.weights_arg == ARG_WEIGHTS:
            _check(lib.dnnl_primitive_execute(self.reorder, stream, 2, self.reorder_args),
                   "reorder")
        _check(lib.dnnl_primitive_execute(self.prim, stream, len(self.args), self.args),
               "execute")
        if self.reorder is not None and self.weights_arg == ARG_DIFF_WEIGHTS:
            _check(lib.dnnl_primitive_execute(self.reorder, stream, 2, self.reorder_args),
                   "reorder")
        _check(lib.dnnl_stream_wait(stream), "wait")

    def __del__(self):
        for name, handle in reversed(getattr(self, "_owned", [])):
            try:
                getattr(self.lib, name)(handle)
            except Exception:  # interpreter shutdown
                pass


class Rounding(Plan):
    """oneDNN's reorder of ``size`` float32 values to bf16 (nearest, ties to even: the bits of
    ``cpu_kernels.bf16.to_bf16``), 5.7x faster than that NumPy helper (3.3M values: 0.66 ms
    against 3.8 ms, one thread; benchmarks/cpu_kernels.py --precision)."""

    def __init__(self, lib, size: int):  # noqa: super().__init__ builds a convolution
        self.lib, self._owned = lib, []
        src, dst = self._md((size,), TAG_A, F32), self._md((size,), TAG_A, BF16)
        reorder_pd = _P()
        _check(lib.dnnl_reorder_primitive_desc_create(ctypes.byref(reorder_pd), src,
                                                      _LOAD["engine"], dst, _LOAD["engine"],
                                                      None), "reorder")
        self._owned.append(("dnnl_primitive_desc_destroy", reorder_pd))
        self.prim = self._create(reorder_pd)
        self.memories = {ARG_SRC: self._memory(src), ARG_DST: self._memory(dst)}
        self.args = (_Arg * 2)(*[_Arg(a, m) for a, m in self.memories.items()])
        self.weights_arg, self.reorder = None, None


def round_bf16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """C-contiguous float32 (any shape) -> uint16 bf16 bits (into ``out``, C-contiguous, if
    given), by this thread's oneDNN reorder."""
    plans = thread_state()["plans"]
    key = ("bf16", x.size)
    if key not in plans:
        while len(plans) >= MAX_PLANS:
            del plans[next(iter(plans))]
        plans[key] = Rounding(_LOAD["lib"], x.size)
    out = np.empty(x.shape, np.uint16) if out is None else out
    plans[key].run(thread_state()["stream"], {ARG_SRC: x, ARG_DST: out})
    return out


MAX_PLANS = 512  # per thread; a model's layers x 3 passes x 2 chunk sizes x train/eval is ~100


def plan(key: Key):
    """This thread's plan for ``key``, built on first use; None where oneDNN cannot build it.

    At most ``MAX_PLANS`` a thread, the oldest dropped first (inputs of ever new sizes)."""
    state = thread_state()
    plans = state["plans"]
    if key not in plans:
        while len(plans) >= MAX_PLANS:
            del plans[next(iter(plans))]
        try:
            plans[key] = Plan(_LOAD["lib"], key)
            stats["plans"] += 1
            if len(impls) < 50:
                impls[str(key)] = plans[key].impl
        except RuntimeError as exc:
            plans[key] = None
            stats["unsupported"] += 1
            log.debug("oneDNN cannot run %s (%s); im2col + BLAS runs it", key, exc)
    return plans[key]
