"""Tests for pipeline.data.datasets: the load- graph, its keys, reads per file, validation errors and downloads."""
from __future__ import annotations

import functools
import hashlib
import http.server
import os
import pickle
import re
import shutil
import socket
import tarfile
import threading
from pathlib import Path

import dask
import numpy as np
import pytest
from dask.utils import key_split

from pipeline.data import cifar
from pipeline.data.cifar import synthetic as cifar_synthetic
from pipeline.data.cifar import task as cifar_task
from pipeline.data import datasets as data
from pipeline.core import files
from pipeline.core.config import DataConfig
from pipeline.core.errors import DataError
from tests.conftest import TINY_TEST, TINY_TRAIN
from tests.helpers import plain_unpickle


def _oracle(directory):
    """The dataset read with plain pickle (trusted: our own fixture) as four NumPy arrays."""
    def read(names):
        batches = [plain_unpickle(os.path.join(directory, n)) for n in names]
        return (np.concatenate([b[b"data"] for b in batches]).reshape(-1, 3, 32, 32),
                np.concatenate([b[b"labels"] for b in batches]).astype(np.int32))
    return (*read([f"data_batch_{i}" for i in range(1, 6)]), *read(["test_batch"]))


def _keys(array, prefix):
    return sorted(k for k in dict(array.__dask_graph__()) if key_split(k) == prefix)


def _token(array) -> str:
    return _keys(array, "load")[0][0].split("-", 1)[1]


# --- the graph ---------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["dir", "tar", "parent"])
def test_load_dataset_equals_the_plain_pickle_oracle(cifar_root, cifar_dir, cifar_tar, which):
    source = {"dir": cifar_dir, "tar": cifar_tar, "parent": cifar_root}[which]  # str or Path
    ds = data.load_dataset(source)
    assert ds.n_classes == 10 and ds.label_names == list(cifar.CIFAR10_LABEL_NAMES)
    assert ds.train_images.shape == (TINY_TRAIN, 3, 32, 32) and ds.test_labels.shape == (TINY_TEST,)
    assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.int32
    got = data.dataset_arrays(ds)
    for array, expected in zip(got, _oracle(cifar_dir)):
        assert type(array) is np.ndarray and array.dtype == expected.dtype
        np.testing.assert_array_equal(array, expected)


def test_synthetic_sources_equal_the_files_synth_writes(cifar_dir):
    on_the_fly = data.dataset_arrays(data.load_dataset(f"synthetic:{TINY_TRAIN}:{TINY_TEST}"))
    for array, expected in zip(on_the_fly, _oracle(cifar_dir)):
        np.testing.assert_array_equal(array, expected)


def test_default_synthetic_is_5000_by_1000_in_five_plus_one_chunks():
    ds = data.load_dataset("synthetic")
    assert ds.source == "synthetic:5000:1000"
    assert ds.train_images.chunks == ((1000,) * 5, (3,), (32,), (32,))
    assert ds.train_labels.chunks == ((1000,) * 5,) and ds.test_images.chunks[0] == (1000,)


def test_one_load_task_per_batch_file_chunked_by_file(cifar_tar):
    ds = data.load_dataset(cifar_tar)
    token = _token(ds.train_images)
    assert re.fullmatch(r"[0-9a-f]{8}", token)
    assert _keys(ds.train_images, "load") == [(f"load-{token}", i) for i in range(5)]
    assert _keys(ds.train_labels, "load") == _keys(ds.train_images, "load")  # shared, not re-read
    assert len(_keys(ds.test_images, "load")) == 1 and _token(ds.test_images) != token
    assert ds.train_images.chunks[0] == (100,) * 5 and ds.train_labels.chunks == ((100,) * 5,)
    assert {key_split(k) for k in dict(ds.train_images.__dask_graph__())} == {"load", "images"}


def test_same_inputs_same_keys_other_inputs_other_keys(cifar_copy, cifar_tar):
    def keys(source):
        ds = data.load_dataset(source)
        return _keys(ds.train_images, "load") + _keys(ds.test_images, "load")
    assert keys(str(cifar_copy)) == keys(str(cifar_copy))
    assert keys("synthetic") == keys("synthetic") == keys("synthetic:5000:1000")
    assert keys("synthetic:600:100") != keys("synthetic")
    assert keys(cifar_tar) != keys(str(cifar_copy))
    before = keys(str(cifar_copy))
    os.utime(cifar_copy / "data_batch_2", ns=(1, 1))  # same bytes, new mtime: maybe new data
    assert keys(str(cifar_copy)) != before


@pytest.mark.parametrize("which", ["dir", "tar"])
def test_compute_reads_each_batch_file_exactly_once(cifar_dir, cifar_tar, monkeypatch, which):
    ds = data.load_dataset(cifar_dir if which == "dir" else cifar_tar)
    reads = []
    reader = "read_file" if which == "dir" else "read_archive"
    original = getattr(cifar_task, reader)  # where load() looks its reader up
    monkeypatch.setattr(cifar_task, reader,
                        lambda path, *a: reads.append((path, *a)) or original(path, *a))
    with dask.config.set(scheduler="threads"):
        data.dataset_arrays(ds)
    assert len(reads) == 6 and len(set(map(str, reads))) == 6


def test_graph_tasks_pickle_and_run_on_a_distributed_client(cifar_tar, dask_client):
    ds = data.load_dataset(cifar_tar)
    graph = dict(ds.train_images.__dask_graph__())
    assert pickle.loads(pickle.dumps(graph)).keys() == graph.keys()
    got = dask_client.compute([ds.train_images, ds.train_labels], sync=True)
    prefixes = dask_client.run_on_scheduler(lambda dask_scheduler: list(
        dask_scheduler.task_prefixes))
    assert {"load", "images", "labels"} <= set(prefixes)  # the dashboard's stage names
    expected = data.dataset_arrays(ds)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def test_a_file_changed_after_opening_fails_the_load_task(cifar_copy):
    ds = data.load_dataset(str(cifar_copy))
    batch = plain_unpickle(cifar_copy / "data_batch_1")
    batch.update({b"data": batch[b"data"][:50], b"labels": batch[b"labels"][:50]})
    (cifar_copy / "data_batch_1").write_bytes(cifar.py2_dumps(batch))
    with pytest.raises(DataError, match="holds 50 images but held 100 .*changed"):
        data.dataset_arrays(ds)


def test_an_invalid_data_config_names_the_field(cifar_dir):
    with pytest.raises(ValueError, match="data.label_kind must be fine or coarse"):
        data.load_dataset(cifar_dir, DataConfig(label_kind="medium"))


def test_cifar100_through_the_data_config(tmp_path):
    images, labels = cifar.synthetic_batch(0, "train", 0, 100)
    fine = labels * 10 + np.arange(100) % 10
    cifar.write_python100(str(tmp_path), (images, fine, fine // 5), (images, fine, fine // 5),
                          [f"f{i}" for i in range(100)], [f"c{i}" for i in range(20)], tar=True)
    for kind, n in [("fine", 100), ("coarse", 20)]:
        cfg = DataConfig(dataset="cifar100", label_kind=kind)
        ds = data.load_dataset(str(tmp_path), cfg)
        assert ds.n_classes == n and len(ds.label_names) == n
        assert ds.train_labels.compute().max() < n
        assert data.inspect_dataset(str(tmp_path / "cifar-100-python.tar.gz"), cfg=cfg)[
            "classes"] == n


# --- inspect -----------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["dir", "tar"])
def test_inspect_gives_counts_shape_names_and_histogram(cifar_dir, cifar_tar, which):
    info = data.inspect_dataset(cifar_dir if which == "dir" else cifar_tar)
    labels = _oracle(cifar_dir)[1]
    assert info == {"train": TINY_TRAIN, "test": TINY_TEST, "classes": 10, "shape": [3, 32, 32],
                    "label_names": list(cifar.CIFAR10_LABEL_NAMES),
                    "class_counts_train": np.bincount(labels, minlength=10).tolist()}
    assert all(type(c) is int for c in info["class_counts_train"]) and type(info["train"]) is int


def test_inspect_synthetic_counts_without_drawing_images(monkeypatch):
    monkeypatch.setattr(cifar_synthetic, "render", lambda *a: pytest.fail("inspect drew images"))
    info = data.inspect_dataset("synthetic:1003:17")
    assert (info["train"], info["test"], sum(info["class_counts_train"])) == (1003, 17, 1003)


# --- bad inputs: each one DataError with the file and the problem on one line ----------------


def _rewrite(directory, name, **entries):
    batch = plain_unpickle(directory / name)
    batch.update({k.encode(): v for k, v in entries.items()})
    (directory / name).write_bytes(cifar.py2_dumps(batch))


def _data(directory, name="data_batch_2"):
    return plain_unpickle(directory / name)[b"data"]


def _labels(directory, name="data_batch_2"):
    return plain_unpickle(directory / name)[b"labels"]


def _cut(path, keep=0.5):
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw[:int(len(raw) * keep)])


def _tar_of(tmp, members=None, top="cifar-10-batches-py"):
    """``tmp/custom.tar.gz``, written as ``top/`` holding ``members`` (name -> bytes) if given."""
    path = tmp / "custom.tar.gz"
    if members is not None:
        cifar.write_tar(str(path), top, list(members.items()))
    return str(path)


def _empty_dir(tmp):
    (tmp / "empty").mkdir()
    return str(tmp / "empty")


def _official(d):
    return {name: (d / name).read_bytes() for name in sorted(os.listdir(d))}


def _binary(tmp):
    return cifar.write_synthetic(str(tmp / "bin"), 50, 10, fmt="binary")


def _binary_record_label(tmp, value):
    directory = _binary(tmp)
    path = os.path.join(directory, "data_batch_4.bin")
    raw = bytearray(Path(path).read_bytes())
    raw[3073 * 3] = value
    Path(path).write_bytes(bytes(raw))
    return directory


def _cifar100_bad_fine(tmp):
    images, labels = cifar.synthetic_batch(0, "train", 0, 20)
    fine = labels * 10
    fine[4] = 100
    cifar.write_python100(str(tmp), (images, fine, labels), (images, labels, labels),
                          [f"f{i}" for i in range(100)], [f"c{i}" for i in range(20)])
    return str(tmp / "cifar-100-python")


def _mkdir_instead(d, name):
    (d / name).unlink()
    (d / name).mkdir()
    return str(d)


# (id, damage(copy dir, tmp dir) -> source, expected message regex)
BAD = [
    ("nonexistent path", lambda d, t: str(t / "nope"), r"nope: no such file or directory"),
    ("directory without CIFAR data", lambda d, t: _empty_dir(t), r"empty: no CIFAR data here"),
    ("missing batch", lambda d, t: (d / "data_batch_3").unlink() or str(d),
     r"cifar-10-batches-py: missing data_batch_3 \("),
    ("missing meta", lambda d, t: (d / "batches.meta").unlink() or str(d), r"missing batches.meta"),
    ("extra junk file", lambda d, t: (d / "junk.bin").write_bytes(b"x") and str(d),
     r"unexpected file\(s\) junk.bin"),
    ("extra batch file", lambda d, t: shutil.copy(d / "data_batch_1", d / "data_batch_6")
     and str(d), r"unexpected file\(s\) data_batch_6"),
    ("directory instead of file", lambda d, t: _mkdir_instead(d, "data_batch_2"),
     r"data_batch_2: is a directory, expected a file"),
    ("wrong shape (4-d)", lambda d, t: _rewrite(d, "data_batch_2", data=_data(d).reshape(
        -1, 3, 32, 32)) or str(d),
     r"data_batch_2: data has shape \(100, 3, 32, 32\), expected \(N, 3072\)"),
    ("wrong shape (width)", lambda d, t: _rewrite(d, "data_batch_2", data=_data(d)[:, :3000])
     or str(d), r"data has shape \(100, 3000\)"),
    ("wrong dtype", lambda d, t: _rewrite(d, "data_batch_2", data=_data(d).astype(np.float32))
     or str(d), r"data_batch_2: data has dtype float32, expected uint8"),
    ("data is a list", lambda d, t: _rewrite(d, "data_batch_2", data=[1, 2]) or str(d),
     r"data is a list, expected a uint8 array"),
    ("label out of range", lambda d, t: _rewrite(d, "test_batch", labels=[10] + _labels(
        d, "test_batch")[1:]) or str(d),
     r"test_batch: label 10 at index 0 is out of range \[0, 10\)"),
    ("negative label", lambda d, t: _rewrite(d, "data_batch_2", labels=_labels(d)[:7] + [-1]
                                             + _labels(d)[8:]) or str(d), r"label -1 at index 7"),
    ("labels not integers", lambda d, t: _rewrite(d, "data_batch_2", labels=[b"cat"] * 100)
     or str(d), r"labels must be integers, found bytes b'cat'"),
    ("label/data count mismatch", lambda d, t: _rewrite(d, "data_batch_5", labels=_labels(
        d, "data_batch_5")[:-1]) or str(d), r"data_batch_5: 99 labels for 100 images"),
    ("empty batch", lambda d, t: _rewrite(d, "data_batch_1", data=_data(d)[:0], labels=[])
     or str(d), r"data_batch_1: holds no images"),
    ("empty file", lambda d, t: (d / "data_batch_4").write_bytes(b"") or str(d),
     r"data_batch_4: the file is empty"),
    ("truncated batch file", lambda d, t: _cut(d / "data_batch_4") or str(d),
     r"data_batch_4: truncated or corrupt pickle"),
    ("not a pickle", lambda d, t: (d / "data_batch_4").write_bytes(b"GIF89a" * 10) and str(d),
     r"data_batch_4: truncated or corrupt pickle"),
    ("batch is not a dict", lambda d, t: (d / "data_batch_4").write_bytes(cifar.py2_dumps([1]))
     and str(d), r"data_batch_4: holds a list, expected a dict"),
    ("batch without data", lambda d, t: (d / "data_batch_4").write_bytes(cifar.py2_dumps(
        {b"labels": [1]})) and str(d), r"data_batch_4: has no 'data' entry \(keys: labels\)"),
    ("meta with 9 names", lambda d, t: (d / "batches.meta").write_bytes(cifar.py2_dumps(
        {b"label_names": [b"x"] * 9})) and str(d), r"batches.meta: 9 class names in label_names"),
    ("malicious pickle", lambda d, t: (d / "data_batch_3").write_bytes(pickle.dumps(
        cifar.SyntheticChunk, protocol=2)) and str(d),
     r"data_batch_3: refused pickle global pipeline.data.cifar.layout.SyntheticChunk"),
    ("plain file, not an archive", lambda d, t: str(d / "batches.meta"),
     r"batches.meta: corrupt, truncated or not a tar archive"),
    ("truncated archive", lambda d, t: _cut(_tar_of(t, _official(d)), 0.6) or _tar_of(t),
     r"custom.tar.gz: corrupt, truncated or not a tar archive"),
    ("corrupt archive", lambda d, t: _flip(_tar_of(t, _official(d))),
     r"custom.tar.gz: corrupt, truncated or not a tar archive"),
    ("archive missing a batch", lambda d, t: _tar_of(t, {k: v for k, v in _official(d).items()
                                                           if k != "test_batch"}),
     r"custom.tar.gz: missing test_batch"),
    ("archive with a junk member", lambda d, t: _tar_of(t, {**_official(d), "notes.txt": b""}),
     r"custom.tar.gz: unexpected file\(s\) notes.txt"),
    ("archive with a nested member", lambda d, t: _tar_of(t, {**_official(d), "x/y": b""}),
     r"unexpected member cifar-10-batches-py/x/y"),
    ("archive of something else", lambda d, t: _tar_of(t, _official(d), top="photos"),
     r"custom.tar.gz: the archive holds photos/"),
    ("binary batch truncated", lambda d, t: _cut(os.path.join(_binary(t), "test_batch.bin"), 0.99)
     or os.path.join(t, "bin"), r"test_batch.bin: \d+ bytes is not a whole number of 3073-byte"),
    ("binary label out of range", lambda d, t: _binary_record_label(t, 12),
     r"data_batch_4.bin: label 12 at index 3 is out of range \[0, 10\)"),
    ("cifar-100 fine label out of range", lambda d, t: _cifar100_bad_fine(t),
     r"cifar-100-python/train: label 100 at index 4 is out of range \[0, 100\)"),
    ("synthetic with zero images", lambda d, t: "synthetic:0:5", r"synthetic:N:M with N, M >= 1"),
    ("synthetic malformed", lambda d, t: "synthetic:10", r"'synthetic:10' must be synthetic"),
    ("dataset name not downloaded", lambda d, t: "cifar100", r"cifar100: not downloaded yet"),
]


def _flip(path):
    raw = bytearray(Path(path).read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 64):
        raw[i] ^= 0xFF
    Path(path).write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("damage, pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_data_is_a_one_line_data_error_before_any_task_runs(
        cifar_copy, tmp_path, monkeypatch, damage, pattern):
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "empty-cache"))
    source = damage(cifar_copy, tmp_path)
    with pytest.raises(DataError, match=pattern) as err:
        data.load_dataset(source)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_batch_file(cifar_copy):
    (cifar_copy / "data_batch_2").chmod(0)
    with pytest.raises(DataError, match="data_batch_2: cannot read the file .permission denied"):
        data.load_dataset(str(cifar_copy))


@pytest.mark.parametrize("which", ["dir", "tar"])
def test_permission_denied_is_a_data_error_even_as_root(cifar_dir, cifar_tar, monkeypatch, which):
    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(files, "_os_open", denied)  # the one open of the files we read
    with pytest.raises(DataError, match=r"(batches.meta|\.tar\.gz): cannot read the file "
                                        r"\(permission denied\)"):
        data.load_dataset(cifar_dir if which == "dir" else cifar_tar)


def test_a_directory_where_an_archive_member_file_belongs(tmp_path, cifar_dir):
    path = tmp_path / "dir-member.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name in sorted(os.listdir(cifar_dir)):
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            if name == "data_batch_1":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = os.path.getsize(os.path.join(cifar_dir, name))
                with open(os.path.join(cifar_dir, name), "rb") as f:
                    tar.addfile(info, f)
    with pytest.raises(DataError, match=r"dir-member.tar.gz:cifar-10-batches-py/data_batch_1: "
                                        r"is not a regular file"):
        data.load_dataset(str(path))


# --- downloads ---------------------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_root(tmp_path, monkeypatch):
    """A local HTTP server on 127.0.0.1 standing in for www.cs.toronto.edu; yields its directory."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setattr(data, "BASE_URL", f"http://127.0.0.1:{server.server_port}/")
    try:
        yield root
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _md5(path) -> str:
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def test_download_with_the_wrong_md5_is_refused_and_not_kept(http_root, tmp_path):
    (http_root / "cifar-10-python.tar.gz").write_bytes(b"not the archive")
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=r"cifar-10-python.tar.gz: downloaded file failed the MD5 "
                                        r"check \(expected c58f30108f718f92721af3b95e74349a\)"):
        data.fetch("cifar10", "python", cache_dir=str(cache))
    assert not (cache / "cifar-10-python.tar.gz").exists()


def test_download_checks_md5_and_then_uses_the_cache(http_root, tmp_path, cifar_tar, monkeypatch):
    shutil.copy(cifar_tar, http_root / "cifar-10-python.tar.gz")
    monkeypatch.setitem(data.ARCHIVES, ("cifar10", "python"),
                        ("cifar-10-python.tar.gz", _md5(cifar_tar)))
    cache = str(tmp_path / "cache")
    path = data.fetch("cifar10", cache_dir=cache)
    assert path == os.path.join(cache, "cifar-10-python.tar.gz") and _md5(path) == _md5(cifar_tar)
    (http_root / "cifar-10-python.tar.gz").unlink()  # a second fetch must not need the server
    assert data.fetch("cifar10", cache_dir=cache) == path
    cfg = DataConfig(cache_dir=cache)
    assert data.inspect_dataset("cifar10", cfg=cfg)["train"] == TINY_TRAIN
    assert data.load_dataset("cifar10", cfg, download=True).source == path


def test_download_into_a_missing_directory_given_as_data(http_root, tmp_path, cifar_tar,
                                                          monkeypatch):
    shutil.copy(cifar_tar, http_root / "cifar-10-python.tar.gz")
    monkeypatch.setitem(data.ARCHIVES, ("cifar10", "python"),
                        ("cifar-10-python.tar.gz", _md5(cifar_tar)))
    target = tmp_path / "data"
    ds = data.load_dataset(str(target), download=True)
    assert ds.source == str(target / "cifar-10-python.tar.gz") and ds.train_images.shape[0] == 500
    assert data.load_dataset(str(target)).train_images.shape[0] == 500  # now present: no download


def test_download_errors_are_data_errors(http_root, tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"cannot download http://127.0.0.1:\d+/cifar-10-binary"
                                        r".tar.gz \(HTTP status 404\); offline, copy "):
        data.fetch("cifar10", "binary", cache_dir=str(tmp_path / "c"))
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        monkeypatch.setattr(data, "BASE_URL", f"http://127.0.0.1:{s.getsockname()[1]}/")
    with pytest.raises(DataError, match=r"cannot download .* \(connection refused\)"):
        data.fetch("cifar100", cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match="no official archive for dataset 'cifar10' in format 'png'"):
        data.fetch("cifar10", "png")


def test_cache_directory_defaults_and_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(data.CACHE_ENV, raising=False)
    assert data.default_cache_dir() == os.path.expanduser("~/.cache/dask-chainer-pipeline")
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path))
    assert data.default_cache_dir() == str(tmp_path)
    assert data.default_cache_dir("/x") == "/x"
