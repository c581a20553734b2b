"""Plain Python and NumPy under everything: the configuration, errors, seeds, task keys, the
schedule, BLAS threads, interrupts, and safe reads of user files (``files``, ``npz``).

Imports nothing else of the pipeline, nor Dask or Chainer.
"""
