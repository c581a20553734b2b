"""Cluster options a machine cannot honour, round three: one line naming the option, before any
process starts, nothing written."""
from __future__ import annotations

import re
import time
from types import SimpleNamespace

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
    scatter to it fails in the scheduler with KeyError; the replicas are placed again once, and
    a worker gone again is lost work: recovery replays."""
    from pipeline.training import recovery
    from pipeline.training.graph import RoundGraph
    with pytest.raises(KeyError):  # what distributed does
        dask_client.scatter([1], workers=["tcp://127.0.0.1:1"], hash=False)
    graph = object.__new__(RoundGraph)
    graph.client = dask_client
    graph._placement = SimpleNamespace(home=lambda replica: "tcp://127.0.0.1:1")
    graph.replace = lambda: None  # placed again, on the same gone worker: gone again
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


# --------------------------------------------------------------------------------------------
# A worker whose train- result is not a state of its input's form (round three's replay): the
# average and the next round failed on it with a bare KeyError / TypeError / AttributeError (a
# traceback), or averaged a wrong-dtype array silently. Now one line naming the worker, the task
# and its round, exit 2, before anything reads the values.

def _first(change):
    """A params change applied to ``conv1/W`` only."""
    return lambda p: {k: change(v) if k == "conv1/W" else v for k, v in p.items()}


MALFORMED = {
    "missing": (lambda p: {k: v for k, v in p.items() if k != "conv1/W"}, "returned a state without 'conv1/W' (and 0 "
                                                     "more missing)"),
    "extra": (lambda p: {**p, "evil/W": np.zeros(3, np.float32)},
              "returned a state with an unexpected entry 'evil/W' (and 0 more)"),
    "dtype": (_first(lambda v: v.astype(np.float64)),
              "returned 'conv1/W' of float64[16, 3, 3, 3] (expected float32[16, 3, 3, 3])"),
    "huge": (_first(lambda v: np.zeros((2000, 2000), np.float32)),
             "returned 'conv1/W' of float32[2000, 2000] (expected float32[16, 3, 3, 3])"),
    "object": (_first(lambda v: v.astype(object)), "returned 'conv1/W' of object[16, 3, 3, 3]"),
    "list": (lambda p: list(p.values()), "returned a list, not a dict of arrays"),
}


def _malformed_backend(monkeypatch, change, opt=None):
    from pipeline.backends.chainer.backend import ChainerBackend
    real = ChainerBackend.train_steps

    def hostile(self, *args, **kwargs):
        params, new_opt, stats = real(self, *args, **kwargs)
        return change(params), new_opt if opt is None else opt, stats
    monkeypatch.setattr(ChainerBackend, "train_steps", hostile)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_train_result_is_one_line_naming_worker_task_and_round(
        tmp_path, capsys, scheduler, monkeypatch, case):
    from tests.helpers import TRAIN_INFO, assert_one_error_line
    change, expected = MALFORMED[case]
    _malformed_backend(monkeypatch, change)
    code = main(["train", *ARGS, "--epochs", "1", "--scheduler", scheduler,
                 "--out", str(tmp_path / "out")])
    line = assert_one_error_line(capsys.readouterr().err,
                                 TRAIN_INFO + ("ipm: ", "average: "))
    assert code == 2, line
    assert re.match(r"error: worker inproc://\S+ " + re.escape(expected) + r".* for train task "
                    r"\('train-[0-9a-f]{8}', 0, [01]\) \(round 0, replica [01]; a worker of "
                    r"another version of this pipeline\?\)$", line), line


@pytest.mark.timeout(120)
def test_an_optimizer_state_that_is_not_a_dict_is_one_line(tmp_path, capsys, scheduler,
                                                           monkeypatch):
    _malformed_backend(monkeypatch, lambda p: p, opt=[1, 2])
    assert main(["train", *ARGS, "--scheduler", scheduler, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "returned an optimizer state of type list (expected a " \
        "dict) for train task ('train-" in err.strip().splitlines()[-1], err


def test_a_train_result_that_is_not_a_tuple_names_its_task():
    """What the pick tasks read: a worker answering a train- task with anything but its
    TrainResult (was an IndexError / KeyError in the pick task)."""
    from pipeline.core.errors import ClusterError
    from pipeline.training import tasks
    assert tasks.pick(("p", "o", "m"), 2) == "m"
    for value in ({"params": 1}, ("p",), None):
        with pytest.raises(ClusterError, match=r"^task \? returned a \w+, not a tuple of at least "
                                               r"3 part\(s\) \(a worker of another version"):
            tasks.pick(value, 2)


@pytest.mark.timeout(240)
def test_a_malformed_worker_result_ends_the_cli_with_exit_2_and_one_line(tmp_path):
    """The same through ``python -m pipeline train`` on its own local cluster: every process
    (the workers too) loads a sitecustomize that makes train_steps drop an entry."""
    from tests.helpers import REPO, assert_one_error_line, run_cli
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "from pipeline.backends.chainer.backend import ChainerBackend\n"
        "_real = ChainerBackend.train_steps\n"
        "def _hostile(self, *a, **k):\n"
        "    params, opt, stats = _real(self, *a, **k)\n"
        "    params.pop('fc/b')\n"
        "    return params, opt, stats\n"
        "ChainerBackend.train_steps = _hostile\n")
    import os
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{REPO}")
    run = run_cli("train", *ARGS, "--workers", "2", "--out", str(tmp_path / "out"), env=env,
                  timeout=200)
    # any line before it: distributed's worker may warn that the other replica's task was
    # cancelled as the cluster closed
    line = assert_one_error_line(run.stderr, None)
    assert run.returncode == 2, run.stderr
    assert re.match(r"error: worker tcp://127\.0\.0\.1:\d+ returned a state without 'fc/b' \(and "
                    r"0 more missing\) for train task \('train-[0-9a-f]{8}', 0, [01]\) \(round 0, "
                    r"replica [01];", line), line
