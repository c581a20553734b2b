"""Plain Python and NumPy under everything: the configuration, errors, seeds, task keys, the
schedule, BLAS threads, interrupts, safe reads of user files (``files``, ``npz``) and the
state-dict questions every layer asks (``arrays``).

Imports nothing else of the pipeline, nor Dask or Chainer.
"""
