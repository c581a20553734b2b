"""Bad input to `python -m pipeline train`: each case exits 2 with one error line, no traceback and
no outputs.

The data engineer's tests (test_data.py, test_cli_data.py) check each damaged file against the
loader and `inspect`; here the same damage goes through the whole `train` command, which must
refuse it before it writes anything. Most cases run in process through `pipeline.cli.parser.main`
(against the in-process cluster, `--scheduler inproc://...`); a few run as a real subprocess to
prove the exit status and the absence of a traceback. docs/reliability.md lists every case.
"""
from __future__ import annotations

import functools
import http.server
import os
import pickle
import shutil
import threading
from pathlib import Path

import pytest

from pipeline.data import cifar
from pipeline.data import datasets as data
from pipeline.core import files
from pipeline.cli.parser import main
from tests.clusters import free_port
from tests.helpers import (TRAIN_INFO, assert_one_error_line, assert_train_refused, no_cluster,
                           run_cli, tree_bytes)


def run_train(*args: str, timeout: float = 90):
    return run_cli("train", *args, timeout=timeout)


GOOD = ["--data", "synthetic:64:16", "--model", "small-cnn", "--strategy", "ipm",
        "--replicas", "2", "--batch-size", "8", "--mix-every", "2", "--epochs", "0.5",
        "--no-progress"]
# The error line, the last, after none but the connection summary and skipped checkpoints.
_one_error_line = functools.partial(assert_one_error_line, before=TRAIN_INFO)
_train = assert_train_refused


# --- data files, through the whole train command -------------------------------------------------


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _rewrite(directory: Path, name: str, **entries) -> None:
    batch = cifar.safe_unpickle((directory / name).read_bytes(), name)
    batch.update({k.encode(): v for k, v in entries.items()})
    (directory / name).write_bytes(cifar.py2_dumps(batch))


def _batch(directory: Path, name: str = "data_batch_2") -> dict:
    return cifar.safe_unpickle((directory / name).read_bytes(), name)


def _truncated_archive(d: Path, tmp: Path, tar: str) -> str:
    cut = tmp / "cifar-10-python.tar.gz"
    cut.write_bytes(Path(tar).read_bytes()[:400_000])
    return str(cut)


def _as_directory(d: Path, name: str) -> str:
    (d / name).unlink()
    (d / name).mkdir()
    return str(d)


def _malicious(d: Path, tmp: Path, tar: str | None = None) -> str:
    payload = pickle.dumps(_Reduce(os.system, f"touch {tmp / 'pwned'}"), protocol=2)
    (d / "data_batch_3").write_bytes(payload)
    return str(d)


# (id, damage(copy of the tiny CIFAR dir, tmp dir, tarball) -> --data, expected in the line)
BAD_DATA = [
    ("truncated archive", _truncated_archive, "corrupt, truncated or not a tar archive"),
    ("missing batch", lambda d, t, tar: (d / "data_batch_5").unlink() or str(d),
     "missing data_batch_5"),
    ("extra junk file", lambda d, t, tar: (d / "notes.txt").write_text("x") and str(d),
     "unexpected file(s) notes.txt"),
    ("wrong shape", lambda d, t, tar: _rewrite(d, "data_batch_2", data=_batch(d)[b"data"][:, :3000])
     or str(d), "data_batch_2: data has shape (100, 3000), expected (N, 3072)"),
    ("wrong dtype", lambda d, t, tar: _rewrite(
        d, "data_batch_2", data=_batch(d)[b"data"].astype("float32")) or str(d),
     "data_batch_2: data has dtype float32, expected uint8"),
    ("label out of range", lambda d, t, tar: _rewrite(
        d, "test_batch", labels=[10] + _batch(d, "test_batch")[b"labels"][1:]) or str(d),
     "test_batch: label 10 at index 0 is out of range [0, 10)"),
    ("label/data count mismatch", lambda d, t, tar: _rewrite(
        d, "data_batch_5", labels=_batch(d, "data_batch_5")[b"labels"][:-1]) or str(d),
     "data_batch_5: 99 labels for 100 images"),
    ("empty batch", lambda d, t, tar: _rewrite(
        d, "data_batch_1", data=_batch(d, "data_batch_1")[b"data"][:0], labels=[]) or str(d),
     "data_batch_1: holds no images"),
    ("pickle that runs code", _malicious, "data_batch_3: refused pickle global posix.system"),
    ("directory instead of a file", lambda d, t, tar: _as_directory(d, "data_batch_2"),
     "data_batch_2: is a directory, expected a file"),
    ("nonexistent path", lambda d, t, tar: str(t / "nowhere"),
     "nowhere: no such file or directory"),
]


@pytest.mark.parametrize("damage, message", [b[1:] for b in BAD_DATA], ids=[b[0] for b in BAD_DATA])
def test_bad_data(capsys, tmp_path, cifar_copy, cifar_tar, scheduler, damage, message):
    source = damage(cifar_copy, tmp_path, cifar_tar)
    line = _train(capsys, *GOOD, "--data", source, "--scheduler", scheduler,
                  out=tmp_path / "out")
    assert message in line, line
    assert not (tmp_path / "pwned").exists()


def test_unreadable_data_file(capsys, tmp_path, cifar_dir, scheduler, monkeypatch):
    def denied(path, *args, **kwargs):  # as root, chmod 0 would not stop the read
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(files, "_os_open", denied)  # the one open of the files we read
    line = _train(capsys, *GOOD, "--data", cifar_dir, "--scheduler", scheduler,
                  out=tmp_path / "out")
    assert "batches.meta: cannot read the file (permission denied)" in line


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_download_with_the_wrong_md5(capsys, tmp_path, scheduler, monkeypatch):
    www = tmp_path / "www"
    www.mkdir()
    (www / "cifar-10-python.tar.gz").write_bytes(b"not the archive")
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(www)))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    monkeypatch.setattr(data, "BASE_URL", f"http://127.0.0.1:{server.server_port}/")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    try:
        line = _train(capsys, *GOOD, "--data", "cifar10", "--download", "--scheduler",
                      scheduler, out=tmp_path / "out")
    finally:
        server.shutdown()
        server.server_close()
    assert "cifar-10-python.tar.gz: downloaded file failed the MD5 check" in line
    assert not (tmp_path / "cache" / "cifar-10-python.tar.gz").exists()


# --- arguments -----------------------------------------------------------------------------------

BAD_ARGS = [
    ("K < 1", ["--replicas", "0"], "train.replicas must be >= 1, got 0"),
    ("H < 1", ["--mix-every", "0"], "average.mix_every must be a positive step count"),
    ("H malformed", ["--mix-every", "2x"], "average.mix_every must be a positive step count"),
    ("unknown model", ["--model", "vgg"], "vgg"),
    ("unknown strategy", ["--strategy", "swarm"], "train.strategy must be one of"),
    ("unknown policy", ["--augment", "mixup"], "mixup"),
    ("unknown optimizer", ["--optimizer", "lion"], "train.optimizer must be one of"),
    ("negative lr", ["--lr", "-0.1"], "train.lr must be > 0, got -0.1"),
    ("zero epochs", ["--epochs", "0"], "train.epochs must be > 0"),
    ("zero batch", ["--batch-size", "0"], "train.batch_size must be >= 1"),
    ("fan-in 1", ["--fan-in", "1"], "average.fan_in must be >= 2"),
    ("negative prefetch", ["--prefetch", "-1"], "augment.prefetch must be >= 0"),
    ("single with K=2", ["--strategy", "single", "--replicas", "2"],
     "train.replicas must be 1 for strategy single"),
    ("unknown device", ["--device", "tpu"], "train.device must be one of"),
    ("not a number", ["--replicas", "many"], "invalid int value: 'many'"),
    ("unknown option", ["--turbo"], "unrecognized arguments: --turbo"),
    ("malformed synthetic source", ["--data", "synthetic:5"], "must be synthetic or synthetic:N:M"),
    ("half the TLS files", ["--tls-ca-file", "ca.pem"], "cluster.tls needs all of"),
]


@pytest.mark.parametrize("args, message", [b[1:] for b in BAD_ARGS], ids=[b[0] for b in BAD_ARGS])
def test_bad_arguments(capsys, tmp_path, scheduler, args, message):
    line = _train(capsys, *GOOD, *args, "--scheduler", scheduler, out=tmp_path / "out")
    assert message in line, line


def test_batch_larger_than_a_shard(capsys, tmp_path, scheduler):
    line = _train(capsys, *GOOD, "--batch-size", "40", "--scheduler", scheduler,
                  out=tmp_path / "out")
    assert "train.batch_size 40 x train.replicas 2 = 80 is larger than the 64 training" in line


def test_out_dir_that_is_a_file(capsys, tmp_path, scheduler):
    target = tmp_path / "out"
    target.write_text("not a directory")
    line = _train(capsys, *GOOD, "--scheduler", scheduler, out=target)
    assert f"output directory {target} exists and is not a directory" in line
    assert target.read_text() == "not a directory"


# --- resume --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory, dask_client) -> Path:
    """A finished run of GOOD (2 rounds, checkpoint at the end)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *GOOD, "--scheduler", dask_client.scheduler.address,
                 "--out", str(out)]) == 0
    return out


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "run"))


def _damage_all_checkpoints(run: Path) -> None:
    for state in run.glob("checkpoints/round-*/state.npz"):
        state.write_bytes(state.read_bytes()[:100])


RESUME = [
    ("a different run", ["--lr", "0.5"], None,
     "was written by a different run: train.lr is 0.01 there and 0.5 now"),
    ("an incompatible model", ["--model", "resnet20"], None,
     "was written by a different run: model.name is 'small-cnn' there and 'resnet20' now"),
    ("every checkpoint damaged", [], _damage_all_checkpoints, "no readable checkpoint in"),
    ("config.json unreadable", [], lambda r: (r / "config.json").write_text("{"),
     "config.json is unreadable"),
    ("no checkpoints", [], lambda r: shutil.rmtree(r / "checkpoints"), "it has no checkpoints/"),
]


@pytest.mark.parametrize("args, damage, message", [b[1:] for b in RESUME],
                         ids=[b[0] for b in RESUME])
def test_bad_resume(capsys, run_copy, scheduler, args, damage, message):
    if damage:
        damage(run_copy)
    before = tree_bytes(run_copy)
    code = main(["train", "--resume", str(run_copy), "--scheduler", scheduler, *args])
    stdout, stderr = capsys.readouterr()
    assert code == 2 and stdout == "" and message in _one_error_line(stderr), stderr
    assert tree_bytes(run_copy) == before  # nothing truncated, rewritten or added


def test_resume_of_a_directory_without_a_run(capsys, tmp_path, scheduler):
    (tmp_path / "empty").mkdir()
    code = main(["train", "--resume", str(tmp_path / "empty"), "--scheduler", scheduler])
    stdout, stderr = capsys.readouterr()
    assert code == 2 and "no config.json there" in _one_error_line(stderr)
    assert not any((tmp_path / "empty").iterdir())


def test_resume_into_another_out(capsys, run_copy, tmp_path):
    code = main(["train", "--resume", str(run_copy), "--out", str(tmp_path / "other")])
    assert code == 2 and "do not also give a different --out" in _one_error_line(
        capsys.readouterr().err)
    assert not (tmp_path / "other").exists()


def test_out_holding_a_run_is_not_overwritten(capsys, run_copy, scheduler):
    line = _train(capsys, *GOOD, "--scheduler", scheduler, out=run_copy)
    assert "already holds a run; resume it with --resume" in line


# --- cluster state -------------------------------------------------------------------------------


def test_gpu_without_a_gpu_is_refused_before_a_cluster_starts(capsys, tmp_path, monkeypatch):
    import pipeline.cluster.connection
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for an embedded cluster, even on a GPU host
    monkeypatch.setattr(pipeline.cluster.connection, "connect", no_cluster)
    line = _train(capsys, *GOOD, "--device", "gpu", "--workers", "1", out=tmp_path / "out")
    assert "--device gpu: this machine has no GPU for the local cluster" in line
    assert "waited" not in line and "dask worker" not in line  # no advice for another cluster


def test_bad_data_is_refused_before_a_cluster_starts(capsys, tmp_path, monkeypatch):
    import pipeline.cluster.connection
    monkeypatch.setattr(pipeline.cluster.connection, "connect", no_cluster)
    line = _train(capsys, *GOOD, "--data", str(tmp_path / "nowhere"), out=tmp_path / "out")
    assert "nowhere: no such file or directory" in line


def test_no_worker_with_the_gpu_resource_on_a_scheduler(capsys, tmp_path, scheduler):
    line = _train(capsys, *GOOD, "--device", "gpu", "--scheduler", scheduler, out=tmp_path / "out")
    assert "no worker advertises resource 'GPU' (waited 5 s)" in line  # cluster.resource_timeout


def test_refused_input_creates_no_output_directory(capsys, tmp_path, scheduler):
    _train(capsys, *GOOD, "--data", str(tmp_path / "nowhere"), "--scheduler", scheduler,
           out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- a real subprocess: exit status 2, one line, no traceback ------------------------------------


def test_bad_argument_in_a_subprocess(tmp_path):
    result = run_train(*GOOD, "--replicas", "0", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and result.stdout == ""
    assert "train.replicas must be >= 1" in _one_error_line(result.stderr)
    assert not (tmp_path / "out").exists()


def test_out_dir_that_is_a_file_in_a_subprocess(tmp_path):
    (tmp_path / "out").write_text("x")
    result = run_train(*GOOD, "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "is not a directory" in _one_error_line(result.stderr)


def test_unreachable_scheduler_in_a_subprocess(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    result = run_train(*GOOD, "--scheduler", address, "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and result.stdout == ""
    assert f"cannot reach scheduler at {address}" in _one_error_line(result.stderr)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.cluster
def test_malicious_pickle_through_train_in_a_subprocess(tmp_path, cifar_copy):
    source = _malicious(cifar_copy, tmp_path)
    result = run_train(*GOOD, "--data", source, "--workers", "1", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and result.stdout == ""
    assert "refused pickle global posix.system" in _one_error_line(result.stderr)
    assert not (tmp_path / "pwned").exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
