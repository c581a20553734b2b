"""Shared test fixtures: a tiny synthetic CIFAR-10 in the official format (directory, tarball); a client."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.data.cifar import write_synthetic

TINY_TRAIN, TINY_TEST, TINY_SEED = 500, 100, 0  # 100 images per batch file; ~2 MB on disk


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory) -> Path:
    """A directory holding ``cifar-10-batches-py/`` and ``cifar-10-python.tar.gz`` (read-only use)."""
    root = tmp_path_factory.mktemp("cifar")
    write_synthetic(str(root), n_train=TINY_TRAIN, n_test=TINY_TEST, seed=TINY_SEED, tar=True)
    return root


@pytest.fixture(scope="session")
def cifar_dir(cifar_root) -> str:
    """The extracted ``cifar-10-batches-py`` directory: 500 train (5 x 100) / 100 test images."""
    return str(cifar_root / "cifar-10-batches-py")


@pytest.fixture(scope="session")
def cifar_tar(cifar_root) -> str:
    """The same data as the official ``cifar-10-python.tar.gz`` (same member layout)."""
    return str(cifar_root / "cifar-10-python.tar.gz")


@pytest.fixture
def cifar_copy(cifar_dir, tmp_path) -> Path:
    """A private, writable copy of ``cifar_dir`` for tests that damage it."""
    return Path(shutil.copytree(cifar_dir, tmp_path / "cifar-10-batches-py"))


@pytest.fixture(scope="session")
def dask_client():
    """An in-process distributed cluster: 2 workers x 1 thread, no subprocesses, any free port.

    Not the default scheduler: tests call ``dask_client.compute``/``submit`` explicitly, so other
    tests keep dask's local scheduler.
    """
    import distributed
    from threadpoolctl import threadpool_limits
    # Both in-process workers' tasks set the process-wide BLAS thread count and restore it on exit;
    # starting from 1 makes a restore mid-GEMM harmless (a 2-thread GEMM sums in another order,
    # which made the strategy equivalences fail now and then under load).
    threadpool_limits(1)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address="127.0.0.1:0") as cluster, \
            distributed.Client(cluster, set_as_default=False) as client:
        yield client


@pytest.fixture
def scheduler(dask_client) -> str:
    """The in-process cluster's address: ``--scheduler`` it to skip starting a LocalCluster."""
    return dask_client.scheduler.address


# Processes a test may leave running on purpose: multiprocessing's helpers live for the session.
_SESSION_HELPERS = ("resource_tracker", "forkserver", "semaphore_tracker")
_LEFT_WAIT_S = 15.0  # a nanny that lost its scheduler takes ~8 s to give up on its own


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    """Fail the test that leaves a child process running (killed first, so the next test starts
    clean); processes started by wider fixtures (a module's cluster) are theirs to stop."""
    import psutil
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    new = [p for p in me.children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(new, timeout=_LEFT_WAIT_S if new else 0)
    left = []
    for proc in alive:
        try:
            cmd = " ".join(proc.cmdline())[:200]
        except psutil.Error:
            continue
        if not any(h in cmd for h in _SESSION_HELPERS):
            left.append(f"{proc.pid}: {cmd}")
            proc.kill()
    assert not left, f"processes left running after the test: {left}"
