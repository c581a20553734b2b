"""cuDNN graphs through nvidia-cudnn-frontend for CuPy arrays: load the library once, build one graph per key, run it.

Written against ``nvidia-cudnn-frontend`` 1.14.1 (its Python ``pygraph``: ``conv_fprop``,
``conv_dgrad``, ``conv_wgrad``, ``batchnorm``, ``batchnorm_backward``, ``batchnorm_inference``;
``_execute({uid: pointer}, workspace, handle)``), the version ``scripts/gpu/prepare.sh`` carries:
1.8 MB, no dependencies, CUDA 12 and 13, any cuDNN 9 (``nvidia-cudnn-cu12/13``, which PyTorch's
wheels bring). Later releases (1.16+) pull in CUTLASS-DSL and change the handle type.

A graph is built once per key (what it computes, shapes, strides, stride/pad, dtype, TF32) per
thread, on that thread's cuDNN handle, and runs on CuPy's current stream with a workspace taken
from CuPy's memory pool. A key cuDNN cannot build is remembered as unsupported (one log line) and
its callers use Chainer's functions for it. Strict FP32 by default: engines whose numerical note is
TENSOR_CORE (TF32 on an H100) are deselected unless ``CUPY_TF32=1``, as CuPy does for cuBLAS, and
NONDETERMINISTIC ones always (a run gives the same bits twice).
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
import threading
from typing import NamedTuple

from pipeline.core.errors import one_line

log = logging.getLogger("pipeline.gpu_kernels")

_LOAD = {"tried": False, "module": None, "reason": None}
_LOAD_LOCK = threading.Lock()
_local = threading.local()


# ------------------------------------------------------------------------------------ loading
def _site_dirs() -> list[str]:
    return [p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]


def _preload(patterns: tuple[str, ...]) -> str | None:
    """dlopen (RTLD_GLOBAL) the first file matching one of ``patterns`` under a site dir's nvidia/.

    The frontend dlopens ``libcudnn.so.9`` and ``libcudart.so.<major>`` by name; a library already
    loaded under that soname satisfies those calls, wherever pip put it.
    """
    for base in _site_dirs():
        for pattern in patterns:
            for path in sorted(glob.glob(os.path.join(base, "nvidia", pattern), recursive=True)):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    return path
                except OSError:
                    continue
    return None


def _cuda_major() -> int:
    import cupy
    return cupy.cuda.runtime.runtimeGetVersion() // 1000


def load():
    """The ``cudnn`` module, or None (reason in :func:`unavailable_reason`, logged once)."""
    if _LOAD["tried"]:
        return _LOAD["module"]
    with _LOAD_LOCK:
        if _LOAD["tried"]:
            return _LOAD["module"]
        try:
            major = _cuda_major()
            # only the runtime CuPy runs on: the frontend refuses a process with two majors
            _preload((f"cu{major}/lib/libcudart.so.{major}", f"cuda_runtime/lib/libcudart.so.{major}",
                      f"**/libcudart.so.{major}"))
            _preload(("cudnn/lib/libcudnn.so.9", f"cu{major}/lib/libcudnn.so.9", "**/libcudnn.so.9"))
            import cudnn
            version = cudnn.backend_version()
            _LOAD["module"] = cudnn
            log.info("cuDNN %s through nvidia-cudnn-frontend %s", version,
                     getattr(cudnn, "__version__", "?"))
        except Exception as exc:  # ImportError, OSError from dlopen, RuntimeError from the shim
            _LOAD["reason"] = one_line(exc, limit=240)
            log.warning("cuDNN graphs unavailable (%s); convolutions and BatchNorm on CuPy use "
                        "Chainer's functions (pip install '.[cudnn]')", _LOAD["reason"])
        _LOAD["tried"] = True
    return _LOAD["module"]


def unavailable_reason() -> str | None:
    return _LOAD["reason"]


def _reset_for_tests(module=None, reason=None, tried=False) -> None:
    _LOAD.update(tried=tried, module=module, reason=reason)
    _local.__dict__.clear()
    stats.update(built=0, unsupported=0, executed=0)
    errors.clear()


# --------------------------------------------------------------------------------------- keys
class Key(NamedTuple):
    """What one cached graph computes; equal keys share one built graph.

    >>> conv_key("fprop", (8, 3, 32, 32), (16, 3, 3, 3), (1, 1), (1, 1), "float32", False)
    Key(op='conv_fprop', x=(8, 3, 32, 32), w=(16, 3, 3, 3), stride=(1, 1), pad=(1, 1), dtype='float32', tf32=False, layout='nchw')
    """
    op: str
    x: tuple
    w: tuple
    stride: tuple
    pad: tuple
    dtype: str
    tf32: bool
    layout: str = "nchw"


def conv_key(kind: str, x_shape, w_shape, stride, pad, dtype, tf32: bool) -> Key:
    """The key of a convolution graph; ``kind`` is fprop | dgrad | wgrad."""
    if kind not in ("fprop", "dgrad", "wgrad"):
        raise ValueError(f"convolution graph kind must be fprop, dgrad or wgrad, got {kind!r}")
    return Key(f"conv_{kind}", tuple(int(v) for v in x_shape), tuple(int(v) for v in w_shape),
               tuple(int(v) for v in stride), tuple(int(v) for v in pad), str(dtype), bool(tf32))


def bn_key(kind: str, x_shape, dtype, layout: str = "nchw") -> Key:
    """The key of a BatchNorm graph; ``kind`` is train | backward | inference.

    >>> bn_key("train", (8, 16, 32, 32), "float32").op
    'bn_train'
    """
    if kind not in ("train", "backward", "inference"):
        raise ValueError(f"BatchNorm graph kind must be train, backward or inference, got {kind!r}")
    if layout not in ("nchw", "nhwc"):
        raise ValueError(f"BatchNorm layout must be nchw or nhwc, got {layout!r}")
    return Key(f"bn_{kind}", tuple(int(v) for v in x_shape), (), (), (), str(dtype), False, layout)


def out_hw(size: int, k: int, stride: int, pad: int) -> int:
    """Convolution output length (no dilation, no cover_all).

    >>> out_hw(32, 3, 2, 1), out_hw(7, 1, 2, 0)
    (16, 4)
    """
    return (size + 2 * pad - k) // stride + 1


def nchw_strides(shape) -> list[int]:
    """Element strides of a C-contiguous (N, C, H, W) array.

    >>> nchw_strides((2, 3, 4, 5))
    [60, 20, 5, 1]
    """
    n, c, h, w = shape
    return [c * h * w, h * w, w, 1]


def nhwc_strides(shape) -> list[int]:
    """Element strides, in (N, C, H, W) order, of (N, C, H, W) data stored as C-contiguous NHWC.

    >>> nhwc_strides((2, 3, 4, 5))
    [60, 1, 15, 3]
    """
    n, c, h, w = shape
    return [h * w * c, 1, w * c, c]


def tf32_allowed() -> bool:
    """``CUPY_TF32=1`` lets cuDNN pick TF32 tensor-core engines too (CuPy's switch for cuBLAS)."""
    return os.environ.get("CUPY_TF32", "0") == "1"


# ----------------------------------------------------------------------------------- building
class Built(NamedTuple):
    """A built graph and the uids of its tensors by role; ``scalars`` are host values it reads."""
    graph: object
    uids: dict
    workspace: int
    scalars: dict


def _handle():
    """This thread's cuDNN handle (cuDNN handles are not for concurrent use from threads)."""
    handle = getattr(_local, "handle", None)
    if handle is None:
        handle = _local.handle = load().create_handle()
        _local.stream = None
    return handle


def _on_current_stream(cudnn) -> int:
    import cupy
    stream = cupy.cuda.get_current_stream().ptr
    handle = _handle()
    if _local.stream != stream:
        cudnn.set_stream(handle=handle, stream=stream)
        _local.stream = stream
    return handle


def _dtype(cudnn, name: str):
    return {"float32": cudnn.data_type.FLOAT, "float16": cudnn.data_type.HALF}[name]


def _finish(cudnn, graph, key: Key) -> int:
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    # Same bits run to run (the project's byte-identical promise): no engines that add with
    # atomics, none that reduce in less than FP32. Strict FP32 unless CUPY_TF32=1. The filter
    # acts on the plans there are, so it comes after create_execution_plans (before it, it
    # filtered nothing: the H200 run chose TF32 and nondeterministic engines).
    notes = [cudnn.numerical_note.NONDETERMINISTIC,
             cudnn.numerical_note.REDUCED_PRECISION_REDUCTION]
    if not key.tf32:
        notes.append(cudnn.numerical_note.TENSOR_CORE)
    graph.deselect_numeric_notes(notes)
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
    return int(graph.get_workspace_size())


def _new_graph(cudnn, key: Key):
    dt = _dtype(cudnn, key.dtype)
    return cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=_handle())


def _build_conv(cudnn, key: Key) -> Built:
    g = _new_graph(cudnn, key)
    dt = _dtype(cudnn, key.dtype)
    n, _, h, w = key.x
    k = key.w[0]
    y_shape = (n, k, out_hw(h, key.w[2], key.stride[0], key.pad[0]),
               out_hw(w, key.w[3], key.stride[1], key.pad[1]))
    conv = dict(padding=list(key.pad), stride=list(key.stride), dilation=[1, 1],
                compute_data_type=cudnn.data_type.FLOAT)
    if key.op == "conv_fprop":
        x = g.tensor(name="x", dim=list(key.x), stride=nchw_strides(key.x), data_type=dt)
        wt = g.tensor(name="w", dim=list(key.w), stride=nchw_strides(key.w), data_type=dt)
        out = g.conv_fprop(image=x, weight=wt, name="fprop", **conv)
        out.set_output(True).set_dim(list(y_shape)).set_stride(nchw_strides(y_shape))
        roles = {"x": x, "w": wt}
    elif key.op == "conv_dgrad":
        dy = g.tensor(name="dy", dim=list(y_shape), stride=nchw_strides(y_shape), data_type=dt)
        wt = g.tensor(name="w", dim=list(key.w), stride=nchw_strides(key.w), data_type=dt)
        out = g.conv_dgrad(loss=dy, filter=wt, name="dgrad", **conv)
        out.set_output(True).set_dim(list(key.x)).set_stride(nchw_strides(key.x))
        roles = {"dy": dy, "w": wt}
    else:
        x = g.tensor(name="x", dim=list(key.x), stride=nchw_strides(key.x), data_type=dt)
        dy = g.tensor(name="dy", dim=list(y_shape), stride=nchw_strides(y_shape), data_type=dt)
        out = g.conv_wgrad(image=x, loss=dy, name="wgrad", **conv)
        out.set_output(True).set_dim(list(key.w)).set_stride(nchw_strides(key.w))
        roles = {"x": x, "dy": dy}
    out.set_data_type(dt)
    roles["out"] = out
    return _built(cudnn, g, key, roles, {})


def _built(cudnn, g, key: Key, roles: dict, scalars: dict) -> Built:
    """Give every role's tensor its own uid (the frontend numbers tensors only while building,
    so ``get_uid()`` is 0 for all of them before), build, and keep the uids by role."""
    for uid, tensor in enumerate(roles.values(), start=1):
        tensor.set_uid(uid)
    workspace = _finish(cudnn, g, key)
    return Built(g, {role: t.get_uid() for role, t in roles.items()}, workspace, scalars)


def _bn_tensors(g, cudnn, key: Key, names):
    dt = _dtype(cudnn, key.dtype)
    c = key.x[1]
    strides = nchw_strides(key.x) if key.layout == "nchw" else nhwc_strides(key.x)
    x = g.tensor(name="x", dim=list(key.x), stride=strides, data_type=dt)
    per_channel = {name: g.tensor(name=name, dim=[1, c, 1, 1], stride=[c, 1, 1, 1],
                                  data_type=cudnn.data_type.FLOAT) for name in names}
    return x, per_channel, strides


def _build_bn(cudnn, key: Key, eps: float, decay: float) -> Built:
    import numpy as np
    g = _new_graph(cudnn, key)
    dt = _dtype(cudnn, key.dtype)
    if key.op == "bn_train":
        x, t, strides = _bn_tensors(g, cudnn, key, ("gamma", "beta", "mean", "var"))
        scalars = {"eps": np.full((1, 1, 1, 1), eps, np.float32),
                   "momentum": np.full((1, 1, 1, 1), 1.0 - decay, np.float32)}  # cuDNN: 1 - decay
        eps_t, mom_t = (g.tensor(name=k, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                                 data_type=cudnn.data_type.FLOAT, is_pass_by_value=True)
                        for k in ("eps", "momentum"))
        y, saved_mean, saved_inv, next_mean, next_var = g.batchnorm(
            input=x, scale=t["gamma"], bias=t["beta"], in_running_mean=t["mean"],
            in_running_var=t["var"], epsilon=eps_t, momentum=mom_t, name="bn")
        y.set_output(True).set_data_type(dt).set_stride(strides)
        for out in (saved_mean, saved_inv, next_mean, next_var):
            out.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        roles = {"x": x, **t, "eps": eps_t, "momentum": mom_t, "y": y,
                 "saved_mean": saved_mean, "saved_inv_std": saved_inv,
                 "next_mean": next_mean, "next_var": next_var}
    elif key.op == "bn_backward":
        x, t, strides = _bn_tensors(g, cudnn, key, ("gamma", "saved_mean", "saved_inv_std"))
        dy = g.tensor(name="dy", dim=list(key.x), stride=strides, data_type=dt)
        dx, dgamma, dbeta = g.batchnorm_backward(
            grad=dy, input=x, scale=t["gamma"], mean=t["saved_mean"],
            inv_variance=t["saved_inv_std"], name="dbn")
        dx.set_output(True).set_data_type(dt).set_stride(strides)
        dgamma.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        dbeta.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        roles = {"x": x, "dy": dy, **t, "dx": dx, "dgamma": dgamma, "dbeta": dbeta}
        scalars = {}
    else:  # inference with given mean and 1/sqrt(var + eps)
        x, t, strides = _bn_tensors(g, cudnn, key, ("gamma", "beta", "mean", "inv_std"))
        y = g.batchnorm_inference(input=x, mean=t["mean"], inv_variance=t["inv_std"],
                                  scale=t["gamma"], bias=t["beta"], name="bn_inference")
        y.set_output(True).set_data_type(dt).set_stride(strides)
        roles = {"x": x, **t, "y": y}
        scalars = {}
    return _built(cudnn, g, key, roles, scalars)


def get(key: Key, **params) -> Built | None:
    """The built graph for ``key`` (built on first use), or None where cuDNN cannot run it.

    ``params`` (BatchNorm's eps and decay) are part of what is built: they are folded into the
    cache key here.
    """
    cudnn = load()
    if cudnn is None:
        return None
    cache = _local.__dict__.setdefault("graphs", {})
    full_key = (key, tuple(sorted(params.items())))
    if full_key not in cache:
        try:
            cache[full_key] = (_build_conv(cudnn, key) if key.op.startswith("conv")
                               else _build_bn(cudnn, key, params["eps"], params["decay"]))
            _smoke(cache[full_key], key)
        except Exception as exc:  # cudnnGraphNotSupportedError, a build or a first-run failure
            cache[full_key] = None
            reason = one_line(exc, limit=340)
            if len(errors) < 50:
                errors[str(key)] = reason
            # one warning a process; the rest (e.g. every BatchNorm shape) at debug level
            (log.warning if not stats["unsupported"] else log.debug)(
                "cuDNN cannot run %s (%s); Chainer's function runs it%s", key, reason,
                "" if stats["unsupported"] else " (further ones: debug level)")
        stats["built" if cache[full_key] is not None else "unsupported"] += 1
    return cache[full_key]


stats = {"built": 0, "unsupported": 0, "executed": 0}  # per process, read by benchmarks
errors: dict = {}  # str(key) -> why cuDNN could not build it (the first 50), for reports


def _run(built: Built, pointers: dict) -> None:
    import cupy
    cudnn = load()
    handle = _on_current_stream(cudnn)
    workspace = cupy.empty(max(built.workspace, 1), dtype=cupy.uint8)
    variant = {built.uids[role]: array.data.ptr for role, array in pointers.items()}
    for role, value in built.scalars.items():  # pass-by-value scalars: host pointers
        variant[built.uids[role]] = value.ctypes.data
    built.graph._execute(variant, workspace.data.ptr, handle)


def execute(built: Built, pointers: dict) -> None:
    """Run ``built`` on CuPy's current stream; ``pointers`` maps roles to CuPy arrays."""
    _run(built, pointers)
    stats["executed"] += 1


def smoke_shapes(key: Key) -> dict:
    """Role -> shape of the buffers a graph reads and writes (for its first, trial run).

    >>> smoke_shapes(conv_key("dgrad", (2, 3, 9, 9), (4, 3, 3, 3), (2, 2), (1, 1), "float32", False))
    {'x': (2, 3, 9, 9), 'w': (4, 3, 3, 3), 'dy': (2, 4, 5, 5), 'out': (2, 3, 9, 9)}
    >>> smoke_shapes(bn_key("backward", (2, 3, 4, 4), "float32"))["dgamma"]
    (3,)
    """
    if key.op.startswith("conv"):
        n, _, h, w = key.x
        y = (n, key.w[0], out_hw(h, key.w[2], key.stride[0], key.pad[0]),
             out_hw(w, key.w[3], key.stride[1], key.pad[1]))
        out = {"conv_fprop": y, "conv_dgrad": key.x, "conv_wgrad": key.w}[key.op]
        return {"x": key.x, "w": key.w, "dy": y, "out": out}
    full = {"x", "y", "dy", "dx"}
    roles = ("x", "y", "dy", "dx", "gamma", "beta", "mean", "var", "next_mean", "next_var",
             "saved_mean", "saved_inv_std", "dgamma", "dbeta", "inv_std")
    return {r: key.x if r in full else (key.x[1],) for r in roles}


def _smoke(built: Built, key: Key) -> None:
    """Run a new graph once on scratch buffers and wait for it: a graph that builds but fails
    to run is found here (and left to Chainer's functions), not in the middle of a step."""
    import cupy
    shapes = smoke_shapes(key)
    dtype = {"float32": cupy.float32, "float16": cupy.float16}[key.dtype]
    pointers = {role: cupy.zeros(shapes[role], dtype=dtype if len(shapes[role]) == 4
                                 else cupy.float32)
                for role in built.uids if role not in built.scalars}
    if "var" in pointers:  # a variance of zero is fine; keep the running one positive
        pointers["var"] += 1
    _run(built, pointers)
    cupy.cuda.get_current_stream().synchronize()


def cached_keys() -> list:
    """This thread's keys (built or unsupported), for tests and reports."""
    return list(getattr(_local, "graphs", {}))


__all__ = ["load", "unavailable_reason", "Key", "conv_key", "bn_key", "out_hw", "nchw_strides",
           "nhwc_strides", "tf32_allowed", "Built", "get", "execute", "stats", "errors",
           "cached_keys"]
