"""Tests for pipeline.data.cifar: official formats written and read, the restricted unpickler, synthetic data."""
from __future__ import annotations

import copyreg
import hashlib
import io
import os
import pickle
import pickletools
import tarfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data import cifar
from pipeline.core.errors import DataError
from tests.conftest import TINY_TEST, TINY_TRAIN
from tests.helpers import plain_unpickle

OFFICIAL_GLOBALS = {"numpy.core.multiarray _reconstruct", "numpy ndarray", "numpy dtype"}
OFFICIAL_MEMBERS = ["cifar-10-batches-py", "cifar-10-batches-py/data_batch_4",
                    "cifar-10-batches-py/readme.html", "cifar-10-batches-py/test_batch",
                    "cifar-10-batches-py/data_batch_3", "cifar-10-batches-py/batches.meta",
                    "cifar-10-batches-py/data_batch_2", "cifar-10-batches-py/data_batch_5",
                    "cifar-10-batches-py/data_batch_1"]


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# --- the files we write are the official format ------------------------------------------------


def test_directory_and_archive_hold_the_official_files(cifar_dir, cifar_tar):
    assert sorted(os.listdir(cifar_dir)) == sorted(m.split("/")[1] for m in OFFICIAL_MEMBERS[1:])
    with tarfile.open(cifar_tar, "r:gz") as tar:
        assert tar.getnames() == OFFICIAL_MEMBERS
        assert tar.getmember("cifar-10-batches-py").isdir()


def test_batches_load_with_plain_pickle_as_the_official_dicts(cifar_dir):
    for i in range(1, 6):
        batch = plain_unpickle(os.path.join(cifar_dir, f"data_batch_{i}"))
        assert list(batch) == [b"batch_label", b"labels", b"data", b"filenames"]
        assert batch[b"batch_label"] == f"training batch {i} of 5".encode()
        assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (100, 3072)
        assert all(type(c) is int and 0 <= c < 10 for c in batch[b"labels"])
        assert len(batch[b"labels"]) == len(batch[b"filenames"]) == 100
        assert all(isinstance(n, bytes) and n.endswith(b".png") for n in batch[b"filenames"])
    test = plain_unpickle(os.path.join(cifar_dir, "test_batch"))
    assert test[b"batch_label"] == b"testing batch 1 of 1" and test[b"data"].shape == (100, 3072)
    meta = plain_unpickle(os.path.join(cifar_dir, "batches.meta"))
    assert meta == {b"num_cases_per_batch": 100, b"num_vis": 3072,
                    b"label_names": [n.encode() for n in cifar.CIFAR10_LABEL_NAMES]}


def test_batches_load_with_latin1_as_torchvision_reads_them(cifar_dir):
    with open(os.path.join(cifar_dir, "data_batch_2"), "rb") as f:
        batch = pickle.load(f, encoding="latin1")
    assert (batch["data"] == plain_unpickle(os.path.join(cifar_dir, "data_batch_2"))[b"data"]).all()


def test_pickles_are_protocol_2_naming_only_the_official_globals(cifar_dir):
    with open(os.path.join(cifar_dir, "data_batch_1"), "rb") as f:
        raw = f.read()
    # Python 2's cPickle: PROTO 2, EMPTY_DICT, BINPUT 1, MARK, SHORT_BINSTRING 'batch_label' ...
    assert raw.startswith(b"\x80\x02}q\x01(U\x0bbatch_labelq\x02U\x15training batch 1 of 5")
    ops = list(pickletools.genops(raw))
    assert {arg for op, arg, _ in ops if op.name == "GLOBAL"} == OFFICIAL_GLOBALS
    assert "BINBYTES" not in {op.name for op, _, _ in ops}  # Python 2 str, not Python 3 bytes
    assert any(op.name == "BINSTRING" and len(arg) == 100 * 3072 for op, arg, _ in ops)


def test_training_set_is_split_over_five_batches_as_equal_as_possible(tmp_path):
    directory = cifar.write_synthetic(str(tmp_path), n_train=503, n_test=7, seed=1)
    sizes = [len(plain_unpickle(os.path.join(directory, f"data_batch_{i}"))[b"labels"])
             for i in range(1, 6)]
    assert sizes == [101, 101, 101, 100, 100]


@given(n=st.integers(0, 10 ** 6), parts=st.integers(1, 12))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_split_sizes_cover_n_and_differ_by_at_most_one(n, parts):
    sizes = cifar.split_sizes(n, parts)
    assert sum(sizes) == n and len(sizes) == parts and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_same_seed_same_bytes_other_seed_other_data(tmp_path):
    a = cifar.write_synthetic(str(tmp_path / "a"), 60, 10, seed=5, tar=True)
    b = cifar.write_synthetic(str(tmp_path / "b"), 60, 10, seed=5, tar=True)
    c = cifar.write_synthetic(str(tmp_path / "c"), 60, 10, seed=6)
    for name in os.listdir(a):
        assert _sha(os.path.join(a, name)) == _sha(os.path.join(b, name))
    assert _sha(tmp_path / "a" / "cifar-10-python.tar.gz") == \
        _sha(tmp_path / "b" / "cifar-10-python.tar.gz")
    assert _sha(os.path.join(a, "data_batch_1")) != _sha(os.path.join(c, "data_batch_1"))


def test_files_equal_the_on_the_fly_chunks(cifar_dir):
    for i in range(5):
        images, labels = cifar.synthetic_batch(0, "train", i, 100)
        batch = plain_unpickle(os.path.join(cifar_dir, f"data_batch_{i + 1}"))
        assert (batch[b"data"].reshape(-1, 3, 32, 32) == images).all()
        assert batch[b"labels"] == labels.tolist()


@pytest.mark.parametrize("kwargs, field", [
    (dict(n_train=4), "n_train"), (dict(n_test=0), "n_test"), (dict(seed=-1), "seed"),
    (dict(fmt="jpeg"), "fmt")])
def test_write_synthetic_rejects_bad_arguments_naming_them(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cifar.write_synthetic(str(tmp_path), **kwargs)


def test_write_synthetic_onto_a_file_is_a_data_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="cannot write"):
        cifar.write_synthetic(str(tmp_path / "file"), 10, 2)


# --- synthetic data ----------------------------------------------------------------------------


def test_synthetic_batch_is_pure_and_keyed_by_its_coordinates():
    a, la = cifar.synthetic_batch(3, "train", 2, 50)
    b, lb = cifar.synthetic_batch(3, "train", 2, 50)
    assert a.dtype == np.uint8 and a.shape == (50, 3, 32, 32) and la.dtype == np.int32
    assert (a == b).all() and (la == lb).all()
    assert (la == cifar.synthetic_labels(3, "train", 2, 50)).all()
    for other in [(4, "train", 2), (3, "test", 2), (3, "train", 3)]:
        assert not (cifar.synthetic_batch(*other, 50)[0] == a).all()
    with pytest.raises(ValueError, match="split"):
        cifar.synthetic_batch(0, "valid", 0, 5)


def test_synthetic_classes_are_balanced_and_images_use_the_range():
    images, labels = cifar.synthetic_batch(0, "train", 0, 1000)
    assert np.bincount(labels, minlength=10).tolist() == [100] * 10
    assert images.min() == 0 and images.max() == 255 and 60 < images.mean() < 200


def test_synthetic_classes_carry_a_learnable_signal_that_is_not_trivial():
    # A linear probe on 8x8 colour averages: well above chance (10%), far from perfect. (A small
    # CNN reaches ~30% after one epoch and ~50% after two on the default 5,000 images.)
    def features(x):
        x = x.astype(np.float32) / 255
        return np.c_[x.reshape(len(x), 3, 8, 4, 8, 4).mean((3, 5)).reshape(len(x), -1),
                     np.ones(len(x))]
    train = [cifar.synthetic_batch(0, "train", i, 400) for i in range(5)]
    x, y = features(np.concatenate([t[0] for t in train])), np.concatenate([t[1] for t in train])
    test_images, test_labels = cifar.synthetic_batch(0, "test", 0, 500)
    w = np.linalg.solve(x.T @ x + np.eye(x.shape[1]), x.T @ np.eye(10)[y])
    accuracy = float(((features(test_images) @ w).argmax(1) == test_labels).mean())
    assert 0.18 < accuracy < 0.9


def test_task_functions_and_chunk_specs_pickle_round_trip():
    for fn in (cifar.load, cifar.synthetic_batch, cifar.synthetic_labels, cifar.parse_batch,
               cifar.render):
        assert pickle.loads(pickle.dumps(fn)) is fn
    for spec in (cifar.SyntheticChunk(0, "train", 1, 10),
                 cifar.BatchFile("cifar10-python", "/x/cifar-10-python.tar.gz",
                                 "cifar-10-batches-py/data_batch_1", "fine", 100)):
        assert pickle.loads(pickle.dumps(spec)) == spec


# --- reading ---------------------------------------------------------------------------------


def test_scan_counts_and_load_reads_the_same_images_from_dir_and_tar(cifar_dir, cifar_tar):
    from_dir, from_tar = cifar.scan(cifar_dir), cifar.scan(cifar_tar)
    for catalog in (from_dir, from_tar):
        assert catalog.layout == "cifar10-python"
        assert [f.n for f in catalog.train] == [100] * 5 and [f.n for f in catalog.test] == [100]
        assert catalog.label_names == cifar.CIFAR10_LABEL_NAMES
        assert sum(catalog.class_counts_train) == TINY_TRAIN
    assert from_tar.train[0].member == "cifar-10-batches-py/data_batch_1"
    for a, b in zip(from_dir.train + from_dir.test, from_tar.train + from_tar.test):
        (ia, la), (ib, lb) = cifar.load(a), cifar.load(b)
        assert ia.dtype == np.uint8 and ia.shape == (a.n, 3, 32, 32) and la.dtype == np.int32
        assert (ia == ib).all() and (la == lb).all()


def test_scan_finds_the_data_from_the_parent_directory(cifar_root, cifar_dir):
    assert cifar.scan(str(cifar_root)).train[0].path == os.path.join(cifar_dir, "data_batch_1")


def test_binary_version_reads_like_the_python_version(tmp_path, cifar_dir):
    directory = cifar.write_synthetic(str(tmp_path), TINY_TRAIN, TINY_TEST, seed=0, tar=True,
                                      fmt="binary")
    assert sorted(os.listdir(directory)) == ["batches.meta.txt", *[f"data_batch_{i}.bin"
                                             for i in range(1, 6)], "readme.html",
                                             "test_batch.bin"]
    assert os.path.getsize(os.path.join(directory, "test_batch.bin")) == TINY_TEST * 3073
    python = cifar.scan(cifar_dir)
    for source in (directory, str(tmp_path / "cifar-10-binary.tar.gz")):
        binary = cifar.scan(source)
        assert binary.layout == "cifar10-binary" and binary.label_names == python.label_names
        assert binary.class_counts_train == python.class_counts_train
        for a, b in zip(binary.train + binary.test, python.train + python.test):
            assert all((x == y).all() for x, y in zip(cifar.load(a), cifar.load(b)))


def _write_cifar100(out, tar=False):
    images, labels = cifar.synthetic_batch(0, "train", 0, 200)
    fine = (labels * 10 + np.arange(200) % 10).astype(np.int32)  # 100 fine classes
    coarse = fine // 5
    fine_names = [f"fine{i}" for i in range(100)]
    coarse_names = [f"coarse{i}" for i in range(20)]
    cifar.write_python100(str(out), (images, fine, coarse), (images[:50], fine[:50], coarse[:50]),
                          fine_names, coarse_names, tar=tar)
    return images, fine, coarse


@pytest.mark.parametrize("kind, n_classes", [("fine", 100), ("coarse", 20)])
def test_cifar100_fine_and_coarse_labels(tmp_path, kind, n_classes):
    images, fine, coarse = _write_cifar100(tmp_path, tar=True)
    for source in (tmp_path / "cifar-100-python", tmp_path / "cifar-100-python.tar.gz"):
        catalog = cifar.scan(str(source), label_kind=kind, prefer="cifar100")
        assert catalog.layout == "cifar100-python" and len(catalog.label_names) == n_classes
        assert catalog.label_names[0] == f"{kind}0" and [f.n for f in catalog.test] == [50]
        got_images, got_labels = cifar.load(catalog.train[0])
        assert (got_images == images).all()
        assert (got_labels == (fine if kind == "fine" else coarse)).all()


def test_a_numpy2_repickled_batch_is_accepted(tmp_path, cifar_copy):
    path = cifar_copy / "data_batch_1"
    batch = plain_unpickle(path)
    path.write_bytes(pickle.dumps(batch, protocol=4))  # numpy._core.multiarray._reconstruct
    images, labels = cifar.load(cifar.BatchFile("cifar10-python", str(path)))
    assert (images.reshape(100, -1) == batch[b"data"]).all() and labels.tolist() == batch[b"labels"]


# --- the restricted unpickler ----------------------------------------------------------------


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads(marker):
    """Pickles that create ``marker`` when a plain unpickler loads them."""
    shell = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').close()"
    return {
        "os.system": pickle.dumps(_Reduce(os.system, shell), protocol=2),
        "builtins.eval": pickle.dumps(_Reduce(eval, code), protocol=2),
        "builtins.exec/protocol 4": pickle.dumps(_Reduce(exec, code), protocol=4),
        "nested in a batch dict": pickle.dumps({b"data": _Reduce(exec, code), b"labels": [0]},
                                               protocol=2),
        "numpy's runstring": pickle.dumps(_Reduce(np.testing._private.utils.runstring, code, {}),
                                          protocol=2),
        "INST opcode (protocol 0)": f"(S'{shell}'\nios\nsystem\n.".encode(),
    }


@pytest.mark.parametrize("name", list(_payloads("x")))
def test_malicious_pickles_are_refused_and_never_run(tmp_path, name):
    live, refused = tmp_path / "live", tmp_path / "refused"
    pickle.loads(_payloads(live)[name])  # the payload is live: a plain unpickler runs it ...
    assert live.exists()
    with pytest.raises(DataError, match="refused pickle global") as err:
        cifar.safe_unpickle(_payloads(refused)[name], "data_batch_1")
    assert not refused.exists()  # ... ours refuses it before anything runs
    assert str(err.value).startswith("data_batch_1: ") and "\n" not in str(err.value)


def test_extension_registry_opcodes_are_refused_too(tmp_path):
    marker = tmp_path / "ext"
    copyreg.add_extension("posix", "system", 0x7FFF01)
    try:
        raw = b"\x80\x02" + b"\x84\x01\xff\x7f\x00" + b"X" + len(f"touch {marker}").to_bytes(
            4, "little") + f"touch {marker}".encode() + b"\x85R."
        with pytest.raises(DataError, match="refused pickle global posix.system"):
            cifar.safe_unpickle(raw, "b")
    finally:
        copyreg.remove_extension("posix", "system", 0x7FFF01)
    assert not marker.exists()


def test_malicious_batch_file_is_refused_by_scan_and_load(tmp_path, cifar_copy):
    marker = tmp_path / "pwned"
    (cifar_copy / "data_batch_3").write_bytes(_payloads(marker)["os.system"])
    with pytest.raises(DataError, match=r"data_batch_3: refused pickle global posix\.system"):
        cifar.scan(str(cifar_copy))
    with pytest.raises(DataError, match="refused"):
        cifar.load(cifar.BatchFile("cifar10-python", str(cifar_copy / "data_batch_3")))
    assert not marker.exists()


# --- py2_dumps --------------------------------------------------------------------------------

_leaves = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.binary(max_size=300)
_values = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.binary(max_size=8), inner, max_size=4)
                       | st.lists(inner, max_size=5).map(tuple), max_leaves=20)


@given(_values)
@settings(max_examples=80, deadline=None, derandomize=True)
def test_py2_dumps_round_trips_through_plain_and_restricted_unpicklers(value):
    raw = cifar.py2_dumps(value)
    pickletools.dis(raw, out=io.StringIO())  # well-formed opcode stream
    assert pickle.loads(raw, encoding="bytes") == value
    assert cifar.safe_unpickle(raw, "x") == value


@given(st.integers(0, 1200), st.sampled_from([np.uint8, np.int32, np.float32, np.float64]))
@settings(max_examples=30, deadline=None, derandomize=True)
def test_py2_dumps_arrays_round_trip(n, dtype):
    array = (np.arange(n * 3) % 251).astype(dtype).reshape(n, 3)
    for loaded in (pickle.loads(cifar.py2_dumps(array), encoding="bytes"),
                   cifar.safe_unpickle(cifar.py2_dumps(array), "x")):
        assert loaded.dtype == array.dtype and (loaded == array).all()


def test_large_lists_use_batched_appends_and_long_memo_ids():
    value = {b"filenames": [b"f%d" % i for i in range(2500)]}
    raw = cifar.py2_dumps(value)
    assert pickle.loads(raw, encoding="bytes") == value
    assert {op.name for op, _, _ in pickletools.genops(raw)} >= {"APPENDS", "LONG_BINPUT"}
