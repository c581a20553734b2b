"""What a run writes and reads back: the run directory (``run_dir``, its file-system rules in
``fs``), checkpoints, resume checks, the per-round hooks (metrics.jsonl/csv, TensorBoard),
curves (``plots``), the live plot (``live``) and dashboard page (``dashboard``), augmentation
previews.

Front: ``prepare``, ``RunDir`` and the rest of ``pipeline.outputs.run_dir``.
"""
from pipeline.core.exports import lazy

__all__ = ("RUN_FILES", "RUN_DIRS", "prepare", "RunDir")
__getattr__ = lazy(__name__, "pipeline.outputs.run_dir", __all__)
