"""Training: the driver loop (``loop``) with its set-up (``prepare``), attempts (``attempt``),
extensions and triggers; the strategies (``strategies``), what a round submits (``graph``) and
what its tasks run (``tasks``), recovery, telemetry and evaluation.

Front: ``train`` and ``TrainOutput`` (``pipeline.training.loop``).
"""
from pipeline.core.exports import lazy

__all__ = ("train", "TrainOutput")
__getattr__ = lazy(__name__, "pipeline.training.loop", __all__)
