"""Averaging replicas: exact typed sums (``exact``), the one order replicas are added in
(``order``), states cut into byte-range slices (``slices``), replicas on hosts (``placement``),
the cost model (``cost``), tree reduction over futures (``reduction``) and the algorithms
(``algorithms``: tree, sharded, hierarchical).

Front: ``mean``, ``combine``, ``finalize`` and the rest of ``pipeline.averaging.exact``.
"""
from pipeline.core.exports import lazy

__all__ = ("State", "Partial", "is_float", "leaf", "combine", "finalize", "combine_finalize",
           "mean", "outer_step", "squared_distance", "nbytes", "first_nonfinite", "is_finite")
__getattr__ = lazy(__name__, "pipeline.averaging.exact", __all__)
