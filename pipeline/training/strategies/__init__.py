"""Training strategies (parameter mixture, distributed gradient, iterative parameter mixture,
and asynchronous updates; docs/strategies.md), one module each.

A strategy says what a round submits, what "the model" is after a round and what a checkpoint
holds (``base.Strategy``); the driver's loop has no ``if strategy``. A new strategy is one
module with a ``Strategy`` subclass plus its line in ``REGISTRY``.
"""
from __future__ import annotations

import importlib

REGISTRY = {
    "single": "pipeline.training.strategies.single:Single",
    "gradient": "pipeline.training.strategies.gradient:Gradient",
    "mixture": "pipeline.training.strategies.mixture:Mixture",
    "ipm": "pipeline.training.strategies.ipm:IPM",
    "async": "pipeline.training.strategies.asynchronous:Async",
}
NAMES = tuple(REGISTRY)


def get(name: str):
    """The ``Strategy`` class registered as ``name``.

    >>> get("ipm").name
    'ipm'
    """
    if name not in REGISTRY:
        raise ValueError(f"train.strategy must be one of {NAMES}, got {name!r}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)
