"""How many threads a task may use, and the one place that caps BLAS/OpenMP pools to it; which
worker and task the calling code runs in (for messages)."""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_ACTIVE = {"count": 0, "limits": None}  # tasks inside limit_blas_threads in this process


def worker_threads() -> int:
    """Threads of the worker running the current task; the usable cores outside a worker.

    A task that has its worker to itself (a `--nthreads 1` worker, as docs/cluster.md recommends,
    or a task holding all of the worker's CPU resource) can run this many BLAS threads without
    oversubscribing the cores the worker was given; see `limit_blas_threads`.

    >>> worker_threads() >= 1
    True
    """
    try:
        from distributed import get_worker  # present wherever a task runs
        return get_worker().state.nthreads
    except (ImportError, ValueError):  # not inside a task
        pass
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def running_in() -> tuple[str, object]:
    """(worker address, task key) of the task calling this; ``("?", None)`` outside a task.

    >>> running_in()
    ('?', None)
    """
    try:
        from distributed import get_worker  # present wherever a task runs
        worker = get_worker()
        return str(worker.address), worker.get_current_task()
    except (ImportError, ValueError, AttributeError):  # not inside a task
        return "?", None


@contextlib.contextmanager
def limit_blas_threads(threads: int | None = None) -> Iterator[int]:
    """Cap BLAS/OpenMP pools at `threads` (default: `worker_threads()`) for the block; yields it.

    The limit is per process (threadpoolctl), so it is exact on one-thread workers; parallel
    tasks then do not oversubscribe the cores. Threads of one process share it: the first task in
    sets it and the last one out restores it. (Each entering and leaving on its own let a task
    restore the pools while another still computed, which then ran BLAS on two threads and
    rounded differently: in-process clusters lost bit-exactness.)

    >>> with limit_blas_threads(1) as n:
    ...     n
    1
    """
    from threadpoolctl import threadpool_limits
    threads = threads or worker_threads()
    with _LOCK:
        if _ACTIVE["count"] == 0:
            _ACTIVE["limits"] = threadpool_limits(limits=threads)
        _ACTIVE["count"] += 1
    try:
        yield threads
    finally:
        with _LOCK:
            _ACTIVE["count"] -= 1
            if _ACTIVE["count"] == 0:
                _ACTIVE["limits"].restore_original_limits()
                _ACTIVE["limits"] = None
