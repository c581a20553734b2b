"""The module paths from before the packages, for one release: each imports its new module.

``import pipeline.config`` (or ``from pipeline.config import Config``) still works and gives the
very module ``pipeline.core.config``, with a ``DeprecationWarning`` naming the new path and the
release that removes the old one (``REMOVED_IN``); so does
``python -m pipeline.emulated``. Sub-modules of a moved package follow it
(``pipeline.strategies.ipm`` is ``pipeline.training.strategies.ipm``). Installed by
``pipeline/__init__.py``; docs/architecture.md has the map.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

MOVED = {  # old name under pipeline. -> new name under pipeline.
    **{m: f"core.{m}" for m in "config errors rng keys schedule threads interrupt files npz".split()},
    "backend": "backends",
    "chainer_backend": "backends.chainer.backend",
    "compat": "backends.chainer.compat", "state": "backends.chainer.state",
    "models": "backends.chainer.models", "cpu_kernels": "backends.chainer.cpu_kernels",
    **{m: f"cluster.{m}" for m in "watchdog assignments worker_setup emulated".split()},
    "readers": "data.readers", "image_readers": "data.images", "imagefolder": "data.imagefolder",
    "cifar": "data.cifar", "augment_graph": "data.augment",
    "reduce_order": "averaging.order", "shards": "averaging.slices",
    "placement": "averaging.placement", "scaling": "averaging.cost",
    "reduction": "averaging.reduction", "averaging_algorithms": "averaging.algorithms",
    "rundir": "outputs.fs",
    **{m: f"outputs.{m}" for m in "checkpoint resume hooks plots preview live".split()},
    **{m: f"training.{m}" for m in "recovery telemetry graph tasks strategies".split()},
    "evaluation": "training.evaluate", "commands": "cli.commands",
}


def new_name(fullname: str) -> str | None:
    """The module an old ``pipeline.*`` name now lives at, or None where nothing moved.

    >>> new_name("pipeline.config"), new_name("pipeline.strategies.ipm"), new_name("pipeline.core")
    ('pipeline.core.config', 'pipeline.training.strategies.ipm', None)
    """
    head, _, rest = fullname.partition(".")
    if head != "pipeline" or not rest:
        return None
    first, _, tail = rest.partition(".")
    if first not in MOVED:
        return None
    return "pipeline." + MOVED[first] + (f".{tail}" if tail else "")


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and hands back the new module itself (one object under both names)."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=real.origin,
                                              is_package=real.submodule_search_locations is not None)
        spec.has_location = real.has_location  # runpy's __file__ for ``python -m`` under an old name
        spec.loader_state = new
        return spec

    def create_module(self, spec):
        _warn(spec.name, spec.loader_state)
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = (spec.loader_state, module.__spec__)
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state[1]  # the import system set the alias's

    def get_code(self, fullname):  # for ``python -m`` (runpy) under an old name
        new = new_name(fullname)
        _warn(fullname, new)
        return importlib.util.find_spec(new).loader.get_code(new)


REMOVED_IN = "0.2.0"  # the release whose import of an old path fails (ours is 0.1.0: setup.cfg)


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path is removed in {REMOVED_IN}",
                  DeprecationWarning, stacklevel=3)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
