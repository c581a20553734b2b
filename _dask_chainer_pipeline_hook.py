"""Makes a plain ``import chainer`` work in an environment with dask-chainer-pipeline installed,
whatever was imported before it: Chainer 7.8.1 does not import on NumPy 2 without
``pipeline.backends.chainer.shims``.

The package installs ``_dask_chainer_pipeline_hook.pth`` beside this module (setup.py), and
Python runs that line at every start: it puts :class:`ChainerFinder` first on ``sys.meta_path``
and imports nothing else (no NumPy, no Dask, nothing of ``pipeline``). When ``chainer`` itself is
first imported, the finder hands Python Chainer's own spec with a loader that runs its
``__init__`` inside ``shims.importing_chainer()``, and takes itself off ``sys.meta_path``. Where
``pipeline`` is not this distribution's (a user's own ``pipeline`` module first on the path),
nothing is changed.
"""
import os
import sys

NAME = "chainer"


class ChainerFinder:
    """A meta-path finder that answers only for ``chainer``, with Chainer's own spec."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != NAME:
            return None
        import importlib.machinery  # here, not at start: importlib.util alone is 2-6 ms there
        spec = None
        for finder in sys.meta_path:
            if finder is not cls and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader \
                and _ours():
            spec.loader = _shimmed(spec.loader)
        return spec


def _shimmed(loader):
    """Chainer's own loader, whose ``exec_module`` runs inside ``shims.importing_chainer()``."""
    import importlib.machinery

    class ShimmedLoader(importlib.machinery.SourceFileLoader):
        def exec_module(self, module):
            uninstall()
            from pipeline.backends.chainer.shims import importing_chainer
            with importing_chainer():
                super().exec_module(module)

    return ShimmedLoader(loader.name, loader.path)


def _ours() -> bool:
    """Whether ``pipeline`` resolves (found, not imported) to the package beside this module."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("pipeline")
    except (ImportError, ValueError):
        return False
    here = os.path.dirname(os.path.abspath(__file__))
    return spec is not None and spec.origin is not None and \
        os.path.dirname(os.path.dirname(os.path.abspath(spec.origin))) == here


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if ChainerFinder not in sys.meta_path:
        sys.meta_path.insert(0, ChainerFinder)


def uninstall() -> None:
    while ChainerFinder in sys.meta_path:
        sys.meta_path.remove(ChainerFinder)
