"""What must be in place before Chainer 7.8.1 imports on NumPy 2 and Python 3.12, in a module
that imports no Chainer: ``compat`` imports Chainer under it, and so does the import hook
(``_dask_chainer_pipeline_hook``, installed with the package) when a user's module imports
Chainer before anything of ours.

``np.sctypes`` is added only when missing (it stays: ``as_strided`` reads it again in its backward
pass). ``numpy.distutils.system_info`` (off macOS) and ``pkg_resources`` are stood in for while
Chainer imports and leave ``sys.modules`` after (see ``compat`` for why each).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import sys
import types
import warnings

import numpy as np

_LEGACY_SCTYPES = {
    "int": [np.int8, np.int16, np.int32, np.int64],
    "uint": [np.uint8, np.uint16, np.uint32, np.uint64],
    "float": [np.float16, np.float32, np.float64, np.longdouble],
    "complex": [np.complex64, np.complex128, np.clongdouble],
    "others": [bool, object, bytes, str, np.void],
}


def _ensure_sctypes() -> None:
    # as_strided reads np.sctypes at import and again in its backward pass, so this one stays.
    try:
        np.sctypes  # noqa: B018
    except AttributeError:
        np.sctypes = _LEGACY_SCTYPES


def _stub_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@functools.cache
def _pkg_resources_stub() -> types.ModuleType:
    """Just enough of pkg_resources for chainer._environment_check, on importlib.metadata."""

    class ResolutionError(Exception):
        pass

    class DistributionNotFound(ResolutionError):
        pass

    class VersionConflict(ResolutionError):
        pass

    def require(requirement: str):
        """Like pkg_resources.require for one requirement: DistributionNotFound or VersionConflict."""
        from packaging.requirements import Requirement
        req = Requirement(requirement)
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            raise DistributionNotFound(req.name) from None
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            raise VersionConflict(f"{req.name} {version} does not satisfy {requirement}")
        return []

    def get_distribution(name: str):
        return types.SimpleNamespace(version=importlib.metadata.version(name))

    return _stub_module(
        "pkg_resources", require=require, get_distribution=get_distribution,
        DistributionNotFound=DistributionNotFound, VersionConflict=VersionConflict,
        ResolutionError=ResolutionError, WorkingSet=lambda: types.SimpleNamespace(require=require),
    )


@contextlib.contextmanager
def _import_time_stubs():
    """Stand-ins for ``numpy.distutils.system_info`` (off macOS) and ``pkg_resources`` while
    Chainer imports; whatever ``sys.modules`` held under those names before is put back."""
    stubs = {"pkg_resources": _pkg_resources_stub()}
    if sys.platform != "darwin" or not _real_system_info():
        system_info = _stub_module("numpy.distutils.system_info", get_info=lambda name: {})
        stubs["numpy.distutils.system_info"] = system_info
        stubs["numpy.distutils"] = _stub_module("numpy.distutils", system_info=system_info)
    absent = object()
    before = {name: sys.modules.get(name, absent) for name in stubs}
    had_distutils = "distutils" in np.__dict__
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name, module in before.items():
            if module is absent:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if not had_distutils:
            np.__dict__.pop("distutils", None)


def _real_system_info() -> bool:
    """macOS only: whether the real ``numpy.distutils.system_info`` imports (it reads the BLAS)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy.distutils' own deprecation notice
            import numpy.distutils.system_info  # noqa: F401
        return True
    except Exception:
        return False


import_notices: list[str] = []  # Chainer's own warnings at import (e.g. CuPy newer than it knows)
_depth = 0  # importing_chainer blocks open (the hook's inside compat's: one set of stand-ins)


@contextlib.contextmanager
def importing_chainer():
    """The block that imports Chainer: ``np.sctypes``, the stand-ins, and Chainer's warnings kept
    in :data:`import_notices`. A block inside another adds nothing.

    >>> with importing_chainer():
    ...     import chainer
    >>> hasattr(chainer, "Link")
    True
    """
    global _depth
    if _depth:
        yield
        return
    _ensure_sctypes()
    _depth += 1
    try:
        with _import_time_stubs(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        _depth -= 1
    import_notices.extend(" ".join(str(w.message).split()) for w in caught
                          if issubclass(w.category, UserWarning))
