"""A package's front names, imported from the module that defines them on first use.

Package ``__init__``s stay light this way: ``import pipeline.cluster.watchdog`` does not import
Dask because ``pipeline.cluster``'s own front (``connect``, ``describe``, ...) lives in
``pipeline.cluster.connection`` and is only imported when one of those names is asked for.
"""
from __future__ import annotations

import importlib


def lazy(package: str, module: str, names: tuple[str, ...]):
    """A module ``__getattr__`` for ``package`` that takes ``names`` from ``module``.

    >>> get = lazy("pipeline.averaging", "pipeline.averaging.exact", ("mean",))
    >>> get("mean").__module__
    'pipeline.averaging.exact'
    >>> get("nothing")
    Traceback (most recent call last):
    AttributeError: module 'pipeline.averaging' has no attribute 'nothing'
    """
    def __getattr__(name: str):
        if name in names:
            return getattr(importlib.import_module(module), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
