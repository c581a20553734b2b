"""One kernel call's work shared among threads, with the bits of one thread.

``chainer.config.cpu_kernel_threads`` (default 1) says how many threads a kernel may use; the
caller giving a step several cores sets it and BLAS to one thread
(``Backend.using_threads``). Work is cut into pieces that never share an output element or a
partial sum (im2col chunks, images, parameter slices); the calling thread runs the first share
and a process-wide pool the others. NumPy's copies and ufuncs and BLAS release the GIL. Each
piece runs exactly the operations the one-thread loop runs on it, and whatever is summed across
pieces is summed in piece order by the caller, so the result is the same bits at any thread
count, provided each GEMM runs on one BLAS thread (a multi-threaded BLAS call can give other
bits, and two such pools oversubscribe the cores).

>>> run(lambda share: sum(share), deal([1, 2, 3, 4, 5], 2))
[9, 6]
>>> in_order([[1, 3, 5], [2, 4]])
[1, 2, 3, 4, 5]
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from pipeline.backends.chainer.compat import chainer

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def threads() -> int:
    """``chainer.config.cpu_kernel_threads`` (default 1): the threads a kernel call may use."""
    return max(1, int(getattr(chainer.config, "cpu_kernel_threads", 1)))


def bf16() -> bool:
    """Whether ``chainer.config.cpu_precision`` (default "fp32") asks for bf16 convolutions."""
    return getattr(chainer.config, "cpu_precision", "fp32") == "bf16"


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < workers:
            old, _POOL = _POOL, ThreadPoolExecutor(workers, thread_name_prefix="cpu-kernels")
            if old is not None:
                old.shutdown(wait=False)
        return _POOL


def deal(pieces: list, threads: int) -> list:
    """Pieces dealt round-robin into min(threads, len(pieces)) shares."""
    t = max(1, min(threads, len(pieces)))
    return [pieces[i::t] for i in range(t)]


def run(fn, shares: list) -> list:
    """[fn(share) for share in shares]: the first on this thread, the rest on the pool."""
    if len(shares) == 1:
        return [fn(shares[0])]
    futures = [_pool(len(shares) - 1).submit(fn, share) for share in shares[1:]]
    try:
        first = fn(shares[0])
    finally:  # never leave a share writing into buffers the caller is done with
        for f in futures:
            f.exception()
    return [first] + [f.result() for f in futures]


def in_order(parts: list) -> list:
    """Per-share result lists (share i holding pieces i, i+t, ...) -> one list in piece order."""
    ordered = [None] * sum(len(p) for p in parts)
    for i, p in enumerate(parts):
        ordered[i::len(parts)] = p
    return ordered


def slices(size: int, step: int) -> list:
    """[lo, hi) ranges of at most ``step`` cutting ``size``: fixed by the two alone.

    >>> slices(5, 2)
    [(0, 2), (2, 4), (4, 5)]
    """
    return [(lo, min(size, lo + step)) for lo in range(0, size, step)]


def each(fn, bounds: list) -> None:
    """``fn(lo, hi)`` for every range of ``bounds``, the ranges dealt among ``threads()``
    threads (work that writes disjoint parts: the same result at any count).

    >>> seen = []
    >>> each(lambda lo, hi: seen.append((lo, hi)), slices(5, 2)); sorted(seen)
    [(0, 2), (2, 4), (4, 5)]
    """
    run(lambda share: [fn(lo, hi) for lo, hi in share], deal(bounds, threads()))


def ranges(n: int, threads: int) -> list:
    """[lo, hi) ranges cutting ``n`` rows into min(threads, n) contiguous, near-equal parts.

    >>> ranges(5, 2), ranges(1, 3)
    ([(0, 3), (3, 5)], [(0, 1)])
    """
    t = max(1, min(threads, n))
    bounds = [-(-n * i // t) for i in range(t + 1)]
    return list(zip(bounds, bounds[1:]))
