"""The user's model by import path, framework-neutral: the form of a path, importing one the user
named, the path a callable is recorded under, and how its code reaches the workers.

A path is imported only because the user named it (``--model``, ``train(model=...)``); a
config.json alone never makes us import code (``needs_model``), its recorded arguments reach only
the factory recorded with them (``paired``), and what is named must look like a model factory
before anything calls it (``unfit``): a run directory is input, and any importable callable with
keyword parameters (``os:system``) would otherwise be a payload for its ``model.args``.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
import sysconfig
import types

from pipeline.core.errors import UsageError, one_line
from pipeline.core.fields import IMPORT_PATH, is_import_path  # noqa: F401  (re-exported)


def needs_model() -> UsageError:
    """The one line for a run whose config names the user's code and no model was named. It
    never echoes the recorded path: a crafted config.json would have us hint at ``os:system``."""
    return UsageError("this run's model is your own code, which a run directory never imports: "
                      "name it again (--model pkg.module:factory on the command line, model=... "
                      "in Python)")


def needs_optimizer() -> UsageError:
    """``needs_model``'s line for the user's optimizer factory recorded in ``train.optimizer``."""
    return UsageError("this run's optimizer is your own code, which a run directory never "
                      "imports: name it again (--optimizer pkg.module:factory on the command "
                      "line, optimizer=... in Python)")


def paired(recorded: str, named: str) -> None:
    """UsageError unless ``named`` (the model the user gave for a run directory) is the one the
    run recorded: the run's ``model.args`` are then used with the factory they were recorded
    with, never with another. Only user code takes arguments, so two registry names are left to
    the resume's own comparison. The recorded name is not echoed (see ``needs_model``).

    >>> paired("nets:Net", "nets:Net"), paired("small-cnn", "resnet20")
    (None, None)
    """
    if named != recorded and (is_import_path(named) or is_import_path(recorded)):
        raise UsageError(f"this run's model is a different one than the one you named "
                         f"({str(named)[:120]}): a run is resumed and evaluated only with its own "
                         f"model")


def import_factory(path: str, flag: str = "--model"):
    """The object ``pkg.module:factory`` names, imported now (only for a path the user gave to
    ``flag``: --model, --optimizer)."""
    if not is_import_path(path):
        what = flag.lstrip("-")
        raise UsageError(f"{flag} {path[:80]!r} is neither {'an' if what[0] in 'aeiou' else 'a'} "
                         f"{what} name nor an import path pkg.module:factory")
    module_name, attr = path.split(":")
    try:
        obj = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the user's module: any error is theirs to see, in one line
        # (a SystemExit too: sys.exit() at import ended the CLI with exit 0 and no word)
        raise UsageError(f"{flag} {path}: cannot import {module_name} "
                         f"({one_line(exc, limit=200)})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{flag} {path}: {module_name} has no {attr}")
        obj = getattr(obj, part)
    return obj


def path_of(factory) -> str:
    """The import path a factory is recorded under: ``module:qualname``.

    >>> path_of(functools.partial(needs_model))
    'pipeline.backends.user:needs_model'
    """
    if isinstance(factory, functools.partial):
        factory = factory.func
    module = getattr(factory, "__module__", None) or "__main__"
    name = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    return f"{module}:{name}".replace("<locals>.", "")


def _stdlib(obj) -> bool:
    """Whether ``obj`` is defined by the standard library or ``builtins`` (its module's top-level
    name): no model lives there, and ``os``, ``subprocess``, ``shutil``... act on the system."""
    module = getattr(obj, "__module__", None) or ""
    top = module.split(".")[0]
    return top == "builtins" or top in sys.stdlib_module_names


def _what_instance(obj) -> str:
    """What a callable that is neither a class nor a Python function is ("a method-wrapper")."""
    kind = type(obj).__name__
    if not callable(obj):
        return f"a {kind}, not callable"
    return f"a {kind}" if _stdlib(type(obj)) else f"a callable {kind} instance"


def unfit(factory) -> str | None:
    """Why ``factory`` cannot be a model factory, as "a built-in function" and the like; None for
    a class (its framework checks the base class) or a plain Python function (a
    ``functools.partial`` of one too) from outside the standard library, whose return value is
    checked after the call. Built-ins, C functions, method wrappers and callable instances of
    arbitrary types are refused before anything calls them.

    >>> import json
    >>> unfit(len), unfit(json.loads), unfit(is_import_path) is None
    ('a built-in function', 'a function of the standard library (json)', True)
    """
    while isinstance(factory, functools.partial):
        factory = factory.func
    if isinstance(factory, type):
        return None
    if isinstance(factory, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        return "a built-in function"
    if not isinstance(factory, types.FunctionType):
        return _what_instance(factory)
    if _stdlib(factory):
        return f"a function of the standard library ({factory.__module__.split('.')[0]})"
    return None


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
