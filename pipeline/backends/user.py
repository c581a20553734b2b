"""The user's model by import path, framework-neutral: the form of a path, importing one the user
named, the path a callable is recorded under, and how its code reaches the workers.

A path is imported only because the user named it (``--model``, ``train(model=...)``); a
config.json alone never makes us import code (``needs_model``).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
import sysconfig

from pipeline.core.errors import UsageError, one_line

IMPORT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
                         r":[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def is_import_path(name: str) -> bool:
    """Whether ``name`` has the form of an import path ``pkg.module:factory``.

    >>> is_import_path("mymodels.nets:Net"), is_import_path("small-cnn"), is_import_path("os:")
    (True, False, False)
    """
    return isinstance(name, str) and bool(IMPORT_PATH.match(name))


def needs_model(name: str) -> UsageError:
    """The one line for a run whose config names the user's code and no model was named."""
    name = name[:120]
    return UsageError(f"this run's model is {name}, your own code, which a run directory never "
                      f"imports: name it again (--model {name} on the command line, "
                      f"model=... in Python)")


def import_factory(path: str):
    """The object ``pkg.module:factory`` names, imported now (only for a path the user gave)."""
    if not is_import_path(path):
        raise UsageError(f"--model {path[:80]!r} is neither a model name nor an import path "
                         f"pkg.module:factory")
    module_name, attr = path.split(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any error is theirs to see, in one line
        raise UsageError(f"--model {path}: cannot import {module_name} "
                         f"({one_line(exc, limit=200)})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"--model {path}: {module_name} has no {attr}")
        obj = getattr(obj, part)
    return obj


def path_of(factory) -> str:
    """The import path a factory is recorded under: ``module:qualname``.

    >>> path_of(functools.partial(is_import_path))
    'pipeline.backends.user:is_import_path'
    """
    if isinstance(factory, functools.partial):
        factory = factory.func
    module = getattr(factory, "__module__", None) or "__main__"
    name = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    return f"{module}:{name}".replace("<locals>.", "")


def _installed(module) -> bool:
    """Whether ``module`` comes from an installed package (site-packages, the stdlib, ours), so
    the workers import it by reference rather than receiving it by value."""
    name = module.__name__.split(".")[0]
    if name in ("pipeline", "augment") or name in sys.stdlib_module_names:
        return True
    file = getattr(module, "__file__", None) or ""
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
    return any(file.startswith(root) for root in roots if root)


def ship_by_value(factory) -> None:
    """Send the factory's own module by value (cloudpickle) unless it is installed: a worker of
    an external cluster then needs the framework and this package, not the user's file. Code the
    module imports from other local modules still has to be importable on the workers."""
    import cloudpickle
    module = inspect.getmodule(factory.func if isinstance(factory, functools.partial)
                               else factory)
    if module is None or module.__name__ == "__main__" or _installed(module):
        return  # __main__ (a notebook cell, a script) goes by value already
    cloudpickle.register_pickle_by_value(module)
