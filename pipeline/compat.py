"""The one place project code imports Chainer from: makes Chainer 7.8.1 import on NumPy 2 and Python 3.12.

Chainer 7.8.1 (the last release) touches three things at import time that modern stacks removed:

* ``np.sctypes`` (removed in NumPy 2.0), read by ``chainer.functions.array.as_strided``;
* ``numpy.distutils`` (removed on Python 3.12), imported by ``chainer._environment_check``
  only to inspect the BLAS on macOS;
* ``pkg_resources`` (deprecated by setuptools, absent without it), used by the same check to
  warn about CuPy versions.

Each shim is installed only when the real thing is missing; the two import-time stand-ins are
removed again once Chainer has imported, so nothing outside Chainer sees them.
"""
from __future__ import annotations

import contextlib
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


def _pkg_resources_stub() -> types.ModuleType:
    """Just enough of pkg_resources for chainer._environment_check, on importlib.metadata."""

    class DistributionNotFound(Exception):
        pass

    class VersionConflict(Exception):
        pass

    class ResolutionError(Exception):
        pass

    def require(requirement: str):
        name = requirement.split("<")[0].split(">")[0].split("=")[0].split("!")[0].strip()
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise DistributionNotFound(name) from None
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
    added = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy.distutils' own deprecation notice
            import numpy.distutils.system_info  # noqa: F401
    except Exception:
        system_info = _stub_module("numpy.distutils.system_info", get_info=lambda name: {})
        distutils = _stub_module("numpy.distutils", system_info=system_info)
        for name, module in (("numpy.distutils", distutils),
                             ("numpy.distutils.system_info", system_info)):
            sys.modules[name] = module
            added.append(name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # setuptools' own "pkg_resources is deprecated"
            import pkg_resources  # noqa: F401
    except Exception:
        sys.modules["pkg_resources"] = _pkg_resources_stub()
        added.append("pkg_resources")
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)
        np.__dict__.pop("distutils", None)


def _import_chainer():
    _ensure_sctypes()
    with _import_time_stubs(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)  # pkg_resources deprecation, CuPy version notes
        import chainer
        import chainer.functions
        import chainer.gradient_check
        import chainer.links
        import chainer.serializers
    return chainer


chainer = _import_chainer()
F = chainer.functions
L = chainer.links
serializers = chainer.serializers
gradient_check = chainer.gradient_check

__all__ = ["chainer", "F", "L", "serializers", "gradient_check"]
