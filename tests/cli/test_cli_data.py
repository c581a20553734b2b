"""Tests for the CLI's data subcommands (synth, inspect, fetch): output; exit 2 and one line on bad data."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.data import cifar
from pipeline.data import datasets as data
from pipeline.cli.parser import main
from tests.conftest import TINY_TEST, TINY_TRAIN
from tests.helpers import assert_one_error_line, run_cli

REPO = Path(__file__).resolve().parents[2]


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


# --- in a real subprocess ----------------------------------------------------------------------


def test_synth_then_inspect_in_a_subprocess(tmp_path):
    made = run_cli("synth", "--out", str(tmp_path), "--train", "60", "--test", "20", "--seed", "3")
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(tmp_path / "cifar-10-batches-py")
    shown = run_cli("inspect", "--data", made.stdout.strip())
    assert shown.returncode == 0, shown.stderr
    assert len(shown.stdout.strip().splitlines()) == 1
    info = json.loads(shown.stdout)
    assert list(info) == ["train", "test", "classes", "shape", "label_names", "class_counts_train"]
    assert (info["train"], info["test"], info["classes"], info["shape"]) == (60, 20, 10, [3, 32, 32])
    counts = sum(np.bincount(cifar.synthetic_labels(3, "train", i, 12), minlength=10)
                 for i in range(5))
    assert info["class_counts_train"] == counts.tolist() and info["label_names"][0] == "airplane"


def test_malicious_batch_is_refused_with_exit_2_and_never_runs(cifar_copy, tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Reduce(os.system, f"touch {marker}"), protocol=2)
    (cifar_copy / "data_batch_3").write_bytes(payload)
    result = run_cli("inspect", "--data", str(cifar_copy))
    assert result.returncode == 2 and result.stdout == ""
    line = assert_one_error_line(result.stderr)
    assert "data_batch_3: refused pickle global posix.system" in line
    assert not marker.exists()


def test_missing_path_exits_2_with_one_line_in_a_subprocess(tmp_path):
    result = run_cli("inspect", "--data", str(tmp_path / "absent"))
    assert result.returncode == 2
    assert "absent: no such file or directory" in assert_one_error_line(result.stderr)


# --- in process ----------------------------------------------------------------------------


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("which", ["dir", "tar", "parent"])
def test_inspect_prints_one_json_line(capsys, cifar_root, cifar_dir, cifar_tar, which):
    source = {"dir": cifar_dir, "tar": cifar_tar, "parent": str(cifar_root)}[which]
    code, out, err = _run(capsys, "inspect", "--data", source)
    assert code == 0 and err == "" and out.count("\n") == 1
    assert json.loads(out) == data.inspect_dataset(cifar_dir)
    assert json.loads(out)["train"] == TINY_TRAIN and json.loads(out)["test"] == TINY_TEST


def test_inspect_synthetic_sources(capsys):
    assert json.loads(_run(capsys, "inspect", "--data", "synthetic")[1])["train"] == 5000
    info = json.loads(_run(capsys, "inspect", "--data", "synthetic:70:30")[1])
    assert (info["train"], info["test"], sum(info["class_counts_train"])) == (70, 30, 70)


def test_synth_with_tar_and_binary_round_trip_through_inspect(capsys, tmp_path):
    code, out, _ = _run(capsys, "synth", "--out", str(tmp_path), "--train", "25", "--test", "5",
                        "--tar")
    assert code == 0 and out.strip() == str(tmp_path / "cifar-10-batches-py")
    code, out, _ = _run(capsys, "inspect", "--data", str(tmp_path / "cifar-10-python.tar.gz"))
    assert code == 0 and json.loads(out)["train"] == 25


def _damage_label(d):
    batch = cifar.safe_unpickle((d / "test_batch").read_bytes(), "x")
    batch[b"labels"][3] = 11
    (d / "test_batch").write_bytes(cifar.py2_dumps(batch))


BAD = [
    ("missing batch", lambda d: (d / "data_batch_5").unlink(), "missing data_batch_5"),
    ("junk file", lambda d: (d / "x.csv").write_text("1,2"), "unexpected file(s) x.csv"),
    ("label out of range", _damage_label, "test_batch: label 11 at index 3 is out of range"),
    ("truncated batch", lambda d: (d / "data_batch_1").write_bytes(
        (d / "data_batch_1").read_bytes()[:5000]), "data_batch_1: truncated or corrupt pickle"),
    ("directory for a file", lambda d: ((d / "batches.meta").unlink(), (d / "batches.meta").mkdir()),
     "batches.meta: is a directory, expected a file"),
]


@pytest.mark.parametrize("damage, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_data_exits_2_with_one_line(capsys, cifar_copy, damage, message):
    damage(cifar_copy)
    code, out, err = _run(capsys, "inspect", "--data", str(cifar_copy))
    assert code == 2 and out == "" and message in assert_one_error_line(err)


def test_truncated_archive_exits_2(capsys, cifar_tar, tmp_path):
    cut = tmp_path / "cifar-10-python.tar.gz"
    cut.write_bytes(Path(cifar_tar).read_bytes()[:400_000])
    code, _, err = _run(capsys, "inspect", "--data", str(cut))
    assert code == 2 and "corrupt, truncated or not a tar archive" in assert_one_error_line(err)


@pytest.mark.parametrize("args, message", [
    (["inspect", "--data", "synthetic:5"], "must be synthetic or synthetic:N:M"),
    (["inspect", "--data", "cifar10"], "not downloaded yet"),
    (["synth", "--out", "OUT", "--train", "3"], "n_train must be >= 5"),
    (["synth", "--out", "OUT", "--test", "0"], "n_test must be >= 1"),
    (["synth", "--out", "OUT", "--train", "many"], "invalid int value: 'many'"),
    (["fetch", "--dataset", "mnist"], "invalid choice: 'mnist'"),
    (["inspect"], "the following arguments are required: --data"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    args = [str(tmp_path) if a == "OUT" else a for a in args]
    code, _, err = _run(capsys, *args)
    assert code == 2 and message in assert_one_error_line(err)


def test_inspect_download_uses_the_cached_archive(capsys, tmp_path, monkeypatch, cifar_tar):
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(cifar_tar, cache / "cifar-10-python.tar.gz")
    md5 = hashlib.md5(Path(cifar_tar).read_bytes()).hexdigest()
    monkeypatch.setitem(data.ARCHIVES, ("cifar10", "python"), ("cifar-10-python.tar.gz", md5))
    monkeypatch.setattr(data, "BASE_URL", "http://127.0.0.1:9/")  # nothing listens: no network
    monkeypatch.setenv(data.CACHE_ENV, str(cache))
    code, out, err = _run(capsys, "inspect", "--data", "cifar10", "--download")
    assert code == 0 and json.loads(out)["train"] == TINY_TRAIN, err
    code, out, _ = _run(capsys, "fetch", "--dataset", "cifar10")
    assert code == 0 and out.strip() == str(cache / "cifar-10-python.tar.gz")


def test_fetch_failure_exits_2_with_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "BASE_URL", "http://127.0.0.1:9/")  # discard port: refused
    code, _, err = _run(capsys, "fetch", "--dataset", "cifar100", "--cache-dir", str(tmp_path))
    assert code == 2 and "cannot download http://127.0.0.1:9/cifar-100-python.tar.gz" in \
        assert_one_error_line(err)
