"""The Chainer backend: Chainer made to work on NumPy 2 and CuPy 14 (``compat``), the models,
our NumPy kernels for CPU workers (``cpu_kernels``), Links <-> host dicts (``state``) and the
``Backend`` implementation (``backend``). Nothing outside ``pipeline.backends`` imports Chainer
but through ``compat``.
"""
