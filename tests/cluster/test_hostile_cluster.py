"""Cluster options a machine cannot honour, round three: one line naming the option, before any
process starts, nothing written."""
from __future__ import annotations

import time

import numpy as np
import pytest

from pipeline.cli.parser import main
from pipeline.cluster import connection

ARGS = ["--data", "synthetic:64:16", "--model", "small-cnn", "--batch-size", "8", "--replicas",
        "2", "--epochs", "0.1", "--no-progress"]


def test_capacity_counts_cores_and_memory():
    assert connection.capacity(2, 64 << 30) == 8  # cores bound it
    assert connection.capacity(64, 1 << 30) == 4  # memory bounds it
    assert connection.capacity(1, 0) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, expected", [
    (["--workers", "1024"], "error: cluster.workers: 1024 worker processes are more than this "
                            "machine holds: "),
    (["--scheduler", "ucx://127.0.0.1:1", "--connect-timeout", "3"],
     "error: scheduler ucx://127.0.0.1:1: UCX is not installed here (ucx-py or "
     "distributed-ucxx); connect with tcp:// or tls:// instead"),
    (["--workers", "1", "--dashboard-address", "nosuchhost.invalid:8787"],
     "error: cluster.dashboard_address nosuchhost.invalid:8787: cannot resolve host "
     "'nosuchhost.invalid' ("),
])
def test_what_the_machine_cannot_do_is_one_line_before_anything_starts(tmp_path, capsys, args,
                                                                      expected):
    pytest.importorskip("psutil")
    if "ucx" in args[1] and connection.has_ucx():
        pytest.skip("UCX is installed here")
    start = time.monotonic()
    assert main(["train", *ARGS, *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(expected), err
    assert time.monotonic() - start < 30
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_a_scatter_to_a_retired_worker_is_lost_work_not_a_key_error(dask_client):
    """The watchdog retired a worker after this attempt placed a replica on it; the next
    scatter to it fails in the scheduler with KeyError. Now lost work: recovery replays."""
    from pipeline.training import recovery
    from pipeline.training.graph import RoundGraph
    with pytest.raises(KeyError):  # what distributed does
        dask_client.scatter([1], workers=["tcp://127.0.0.1:1"], hash=False)
    graph = object.__new__(RoundGraph)
    graph.client = dask_client
    graph._home = lambda replica: "tcp://127.0.0.1:1"
    with pytest.raises(ConnectionError, match=r"scatter to \['tcp://127.0.0.1:1'\]: the worker "
                                              r"is gone") as err:
        graph.scatter_many([np.zeros(3)], replica=0)
    decision = recovery.decide(err.value, recovery.ClusterState(True), 0, where="",
                               stopped_in=0)
    assert isinstance(decision, recovery.Replay)


@pytest.mark.timeout(30)
def test_tls_files_that_would_block_or_never_end_are_refused(tmp_path):
    """The ssl module opens TLS files plainly: a FIFO would block it, a sparse file be read."""
    import os
    from pipeline.core.config import ClusterConfig
    from pipeline.core.errors import ClusterError
    os.mkfifo(tmp_path / "ca.pem")
    with open(tmp_path / "cert.pem", "wb") as f:
        f.truncate(1 << 40)
    (tmp_path / "key.pem").write_text("key")
    cfg = ClusterConfig(tls_ca_file=str(tmp_path / "ca.pem"), tls_cert=str(tmp_path / "cert.pem"),
                        tls_key=str(tmp_path / "key.pem"))
    with pytest.raises(ClusterError, match=r"cluster.tls_ca_file \(--tls-ca-file\): '.*ca.pem' is "
                                           r"a FIFO \(named pipe\), expected a regular file"):
        connection.security_from(cfg)
    os.unlink(tmp_path / "ca.pem")
    (tmp_path / "ca.pem").write_text("ca")
    with pytest.raises(ClusterError, match=r"cluster.tls_cert \(--tls-cert\): '.*cert.pem' holds "
                                           r"1099511627776 bytes, more than a PEM file"):
        connection.security_from(cfg)
