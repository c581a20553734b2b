"""Data: the reader registry (synthetic, CIFAR, image folders, file lists) as Dask graphs of
``load-``/``decode-`` tasks, the CIFAR formats (``cifar``), image folders (``imagefolder``,
``images``), the ``augment-`` stage (``augment``), download and inspect.

Front: ``load_dataset``, ``inspect_dataset``, ``READERS`` and the rest of
``pipeline.data.datasets``.
"""
from pipeline.core.exports import lazy

__all__ = ("BASE_URL", "ARCHIVES", "DATASET_NAMES", "CACHE_ENV", "SYNTHETIC_SIZES",
           "SYNTHETIC_SEED", "MAX_SYNTHETIC", "Dataset", "load_dataset", "inspect_dataset",
           "dataset_arrays", "parse_synthetic", "READERS", "resolve_source", "default_cache_dir",
           "fetch", "download_failure")
__getattr__ = lazy(__name__, "pipeline.data.datasets", __all__)
