"""Shared by the training benchmarks: make the repo importable, a LocalCluster, timing helpers."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


@contextlib.contextmanager
def local_client(workers: int, threads: int = 1, resources: dict | None = None):
    """A LocalCluster of worker processes on 127.0.0.1 (no dashboard) and its client."""
    from distributed import Client, LocalCluster
    with LocalCluster(n_workers=workers, threads_per_worker=threads, processes=True,
                      dashboard_address=None, host="127.0.0.1", resources=resources) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(workers)
        yield client


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def emit(figures: dict) -> None:
    """The last line of every benchmark: one JSON object."""
    print(json.dumps(figures), flush=True)
