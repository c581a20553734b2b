"""The one place project code imports Chainer from: makes Chainer 7.8.1 import on NumPy 2 and Python 3.12.

Chainer 7.8.1 (the last release) touches three things at import time that modern stacks removed:

* ``np.sctypes`` (removed in NumPy 2.0), read by ``chainer.functions.array.as_strided``;
* ``numpy.distutils`` (removed on Python 3.12), imported by ``chainer._environment_check``
  only to inspect the BLAS on macOS;
* ``pkg_resources`` (deprecated by setuptools, absent without it), used by the same check to
  warn about CuPy versions.

``np.sctypes`` is added only when missing (``shims``, which imports no Chainer: the import hook
the package installs, ``_dask_chainer_pipeline_hook``, applies it to a user's plain ``import
chainer`` that comes before ours). The other two are stood in for while Chainer imports,
whether or not the real ones exist: the real ``numpy.distutils.system_info`` (0.13 s to import)
is read only on macOS, and the real ``pkg_resources.require`` takes 0.1-0.45 s to look up
Chainer's 17 optional package names, in the driver and again in every worker process. The
stand-ins leave ``sys.modules`` once Chainer has imported (a real module that was there before is
put back), but the Chainer modules that imported ``pkg_resources`` (``_environment_check``,
``testing.helper``, ``testing.doctest_helper``) keep the stand-in as their global, so it honours
version specifiers the way the real ``require`` does. ``chainer.gradient_check`` (which imports
pytest through ``chainer.testing``, 0.11 s) is imported on first use of :data:`gradient_check`.

It also answers whether Chainer's CUDA backend can run here (:func:`cuda_status`). Chainer 7.8.1
was written for CuPy 7; on CuPy 13 and 14 its CUDA path imports and runs (see docs/gpu.md), but
two things changed under it: CuPy 14 ships no cuDNN, so convolutions and pooling run as Chainer's
own im2col + cuBLAS kernels, and a plain ``cupy-cuda13x`` wheel finds no cuBLAS unless the CUDA
toolkit is installed (``cupy-cuda13x[ctk]``), which leaves ``chainer.backends.cuda.available``
False with the reason stored in a private attribute. Chainer's notices from import (e.g. that
CuPy 14 is newer than the versions it knows) are kept in :data:`import_notices`, not dropped.
"""
from __future__ import annotations

import importlib.metadata
import warnings

import numpy as np

from pipeline.backends.chainer.shims import _import_time_stubs, import_notices, importing_chainer
from pipeline.core.errors import one_line

def _import_chainer():
    with importing_chainer():
        import chainer
        import chainer.functions
        import chainer.links
        import chainer.serializers
    return chainer


chainer = _import_chainer()


def _patch_batch_norm_reductions() -> None:
    """BatchNormalization's per-channel sums on CuPy in two stages: over (H, W), then over N.

    Without cuDNN, Chainer reduces an (N, C, H, W) batch over axes (0, 2, 3) with one CuPy
    reduction whose C outputs get one thread block each: 16 blocks on a 132-SM H100. Those
    reductions were 19 ms of resnet20's 29 ms of kernels per step at batch 100 and 148 of 197 ms
    at batch 512 (benchmarks/gpu.py). Summing over the contiguous (H, W) first gives N x C
    blocks. NumPy keeps Chainer's own code: CPU results are unchanged.
    """
    from chainer.functions.normalization import batch_normalization as bn
    impl = bn.GeneralBatchNormalizationImpl
    mean_and_var, ggamma_and_gbeta = impl.get_mean_and_var, impl.get_ggamma_and_gbeta

    def nchw_on_gpu(axis, x, xp) -> bool:
        return xp is not np and x.ndim == 4 and tuple(axis) == (0, 2, 3)

    def channel_sum(x, dtype):
        return x.sum(axis=(2, 3), dtype=dtype).sum(axis=0, dtype=dtype)

    def get_mean_and_var(self, axis, gamma, x, xp, interm_dtype):
        if not nchw_on_gpu(axis, x, xp):
            return mean_and_var(self, axis, gamma, x, xp, interm_dtype)
        m = interm_dtype.type(x.size // x.shape[1])
        mean = channel_sum(x, interm_dtype) / m
        centred = x.astype(interm_dtype) - mean[None, :, None, None]
        xp.square(centred, out=centred)
        return mean, channel_sum(centred, interm_dtype) / m

    def get_ggamma_and_gbeta(self, axis, gamma, gy, x_hat, xp):
        if not nchw_on_gpu(axis, gy, xp):
            return ggamma_and_gbeta(self, axis, gamma, gy, x_hat, xp)
        return channel_sum(gy, gamma.dtype), channel_sum(gy * x_hat, gamma.dtype)

    impl.get_mean_and_var, impl.get_ggamma_and_gbeta = get_mean_and_var, get_ggamma_and_gbeta


_patch_batch_norm_reductions()


def _patch_load_npz_without_pickles() -> None:
    """``chainer.serializers.load_npz`` reads with ``numpy.load(allow_pickle=False)``.

    Chainer 7.8.1 opens every ``.npz`` with ``allow_pickle=True``: an object array in the file, or
    a bare pickle given the name ``.npz``, runs code when loaded (docs/reliability.md,
    Hardening 1). Weights are plain numeric arrays, so nothing a real weights file holds is lost;
    a pickled member raises numpy's ``ValueError``. Our own reader
    (``pipeline.backends.chainer.state.load_npz``) also checks names, shapes and sizes before reading.
    """
    import numpy
    from chainer import serializers
    from chainer.serializers import npz

    def load_npz(file, obj, path="", strict=True, ignore_names=None):
        with numpy.load(file, allow_pickle=False) as f:
            npz.NpzDeserializer(f, path=path, strict=strict, ignore_names=ignore_names).load(obj)

    load_npz.__doc__ = npz.load_npz.__doc__
    npz.load_npz = serializers.load_npz = load_npz


_patch_load_npz_without_pickles()


def cuda_status(check_device: bool = False) -> str | None:
    """None when Chainer can train on CUDA here; otherwise one line that says why not.

    Looks only at imports unless ``check_device``, which also asks the CUDA runtime for a device
    (that initialises the driver: call it on GPU workers, not in the driver process).

    >>> cuda_status() is None or isinstance(cuda_status(), str)
    True
    """
    from chainer.backends import cuda
    packages = installed_cupy_packages()
    if len(packages) > 1:
        return (f"{len(packages)} CuPy packages are installed over each other ({', '.join(packages)});"
                f" uninstall all but the one matching the CUDA driver")
    if not cuda.available:
        error = getattr(cuda, "_resolution_error", None)
        if isinstance(error, ModuleNotFoundError) and error.name == "cupy":
            return ("CuPy is not installed (pip install 'cupy-cuda13x[ctk]' or 'cupy-cuda12x[ctk]', "
                    "matching the CUDA driver)")
        detail = one_line(error, kind=False)
        package = packages[0] if packages else "cupy-cuda13x"
        hint = (f"; install the CUDA libraries too: pip install '{package}[ctk]' (or the CUDA "
                f"toolkit)" if "libcublas" in detail or "Failure finding" in detail else "")
        return f"Chainer's CUDA backend cannot load CuPy: {detail[:300]}{hint}"
    if check_device:
        try:
            count = cuda.cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:
            return f"CuPy sees no usable CUDA device: {one_line(exc, kind=False, limit=300)}"
        if count < 1:
            return "CuPy sees no CUDA device"
    return None


def cuda_summary() -> str:
    """One line on the CUDA stack Chainer runs on (call where CUDA is available)."""
    from chainer.backends import cuda
    cupy = cuda.cupy
    runtime = cupy.cuda.runtime.runtimeGetVersion()
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    conv = ("cuDNN" if cuda.cudnn_enabled else
            "im2col + cuBLAS (this CuPy has no cuDNN; Chainer 7 cannot use CuPy 13+'s cuDNN)")
    return (f"Chainer {chainer.__version__} on CuPy {cupy.__version__}, CUDA runtime "
            f"{runtime // 1000}.{runtime % 1000 // 10}, {name}; convolutions: {conv}")


def installed_cupy_packages() -> list[str]:
    """Distributions that provide ``cupy`` (more than one means two CuPys over each other)."""
    names = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "cupy" or name.startswith("cupy-cuda") or name.startswith("cupy-rocm"):
            names.add(name)
    return sorted(names)
F = chainer.functions
L = chainer.links
serializers = chainer.serializers


def __getattr__(name: str):
    """``gradient_check`` on first use (it imports pytest), under the same stand-ins."""
    if name == "gradient_check":
        with _import_time_stubs(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import chainer.gradient_check
        globals()["gradient_check"] = chainer.gradient_check
        return chainer.gradient_check
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["chainer", "F", "L", "serializers", "gradient_check", "cuda_status", "cuda_summary",
           "import_notices", "installed_cupy_packages"]
