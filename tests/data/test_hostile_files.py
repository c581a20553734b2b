"""Hostile files: no file we load runs code, crashes the process, reads memory it did not allocate,
allocates more than its own size justifies, or hangs.

Three classes of the hardening issue: weights that run code (1), pickles that declare arrays or
dtypes larger than their bytes (2), reads without a bound (6). Each payload that would run code
creates a file when it runs; the tests assert the file never appears (and, once, that the
payload is live: a plain loader does run it). docs/reliability.md lists every case and message.
"""
from __future__ import annotations

import gzip
import io
import os
import pickle
import re
import struct
import subprocess
import sys
import tarfile
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pipeline.data import cifar
from pipeline.data import datasets as data
from pipeline.core import npz
from pipeline.cli.parser import main
from pipeline.core.errors import DataError
from tests.clusters import REPO
from tests.helpers import run_cli

try:  # the name NumPy itself pickles arrays with
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - NumPy 1.x
    from numpy.core.multiarray import _reconstruct

MIB = 1 << 20


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _touch(marker: Path) -> _Reduce:
    """An object whose unpickling creates ``marker``."""
    return _Reduce(os.system, f"touch {marker}")


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[-1]


# --- 1. weights never run code ------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A good small-cnn model.npz, as training writes it."""
    from pipeline.training import tasks
    path = tmp_path_factory.mktemp("weights") / "model.npz"
    path.write_bytes(npz.to_bytes(tasks.init_params("small-cnn", 10, 0), compress=True))
    return path


def _object_array_npz(path: Path, marker: Path) -> Path:
    """Every entry of small-cnn, each an object array whose element runs the payload."""
    from pipeline.training import tasks
    names = tasks.init_params("small-cnn", 10, 0)
    np.savez(path, **{k: np.array([_touch(marker)], dtype=object) for k in names})
    return path


def _bare_pickle(path: Path, marker: Path) -> Path:
    path.write_bytes(pickle.dumps(_touch(marker)))
    return path


def test_the_payloads_are_live_for_numpy_but_not_through_compat(tmp_path):
    """The payloads run under ``np.load(allow_pickle=True)``, what Chainer 7.8.1's own
    ``load_npz`` calls; the ``serializers.load_npz`` that compat hands out refuses them."""
    import pickle as pickle_module

    from pipeline.backends.chainer.compat import serializers
    from pipeline.backends.chainer.models import build_model
    live = tmp_path / "live"
    with np.load(_object_array_npz(tmp_path / "o.npz", live), allow_pickle=True) as f:
        f["conv1/W"]
    assert live.exists()  # what `evaluate --weights` and the README's recipe did before
    live.unlink()
    pickle_module.loads(_bare_pickle(tmp_path / "p.npz", live).read_bytes())
    assert live.exists()
    live.unlink()
    for path in (tmp_path / "o.npz", tmp_path / "p.npz"):
        with pytest.raises(ValueError, match="allow_pickle"):
            serializers.load_npz(str(path), build_model("small-cnn"))
        assert not live.exists(), path


def _damaged(weights: Path, tmp_path: Path, marker: Path) -> dict:
    raw = weights.read_bytes()
    huge = io.BytesIO()  # the model's entries, but conv1/W declares a (10**9, 10**9) array
    with zipfile.ZipFile(huge, "w") as zf:
        for name, value in npz.read(weights).items():
            if name != "conv1/W":
                zf.writestr(f"{name}.npy", _npy_bytes(value))
        header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 1000000000), }"
        zf.writestr("conv1/W.npy", b"\x93NUMPY\x01\x00" + struct.pack("<H", 118) +
                    header.ljust(117).encode() + b"\n" + b"\0" * 64)
    twice = io.BytesIO(raw)  # a second conv1/W: which one would count?
    with zipfile.ZipFile(twice, "a") as zf, pytest.warns(UserWarning, match="Duplicate name"):
        zf.writestr("conv1/W.npy", _npy_bytes(np.zeros((16, 3, 3, 3), np.float32)))
    os.mkfifo(tmp_path / "fifo.npz")
    (tmp_path / "zero.npz").symlink_to("/dev/zero")
    return {
        "an object array": (_object_array_npz(tmp_path / "obj.npz", marker),
                            "refused dtype '|O'"),
        "a bare pickle named .npz": (_bare_pickle(tmp_path / "pickle.npz", marker),
                                     "holds a pickle, not an .npz archive"),
        "truncated": (_write(tmp_path / "cut.npz", raw[:len(raw) // 2]),
                      "corrupt or truncated .npz archive"),
        "garbage": (_write(tmp_path / "junk.npz", os.urandom(4096)), "not an .npz archive"),
        "empty": (_write(tmp_path / "empty.npz", b""), "the file is empty"),
        "a bare .npy": (_npy(tmp_path / "one.npz"), "a single .npy array"),
        "a header larger than its data": (_write(tmp_path / "huge.npz", huge.getvalue()),
                                          "declares shape (1000000000, 1000000000)"),
        "a duplicated member": (_write(tmp_path / "twice.npz", twice.getvalue()),
                                "holds two members named 'conv1/W.npy'"),
        "a FIFO": (tmp_path / "fifo.npz", "is a FIFO (named pipe), expected a regular file"),
        "/dev/zero": (tmp_path / "zero.npz", "is a character device, expected a regular file"),
        "a directory": (tmp_path, "is a directory, expected a file"),
        "missing": (tmp_path / "nowhere.npz", "no such file"),
    }


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _npy(path: Path) -> Path:
    with open(path, "wb") as f:
        np.save(f, np.zeros(3, np.float32))
    return path


@pytest.mark.timeout(60)
def test_evaluate_refuses_every_hostile_weights_file_in_one_line(weights, tmp_path, capsys):
    marker = tmp_path / "pwned"
    for name, (path, message) in _damaged(weights, tmp_path, marker).items():
        rc = main(["evaluate", "--model", "small-cnn", "--weights", str(path), "--data",
                   "synthetic:20:10"])
        captured = capsys.readouterr()
        assert rc == 2 and captured.out == "", (name, captured)
        line = _one_line(captured.err)
        assert message in line and str(path) in line, (name, line)
    assert not marker.exists()


def test_weights_of_another_model_say_which_entry(weights, capsys):
    rc = main(["evaluate", "--model", "resnet20", "--weights", str(weights), "--data",
               "synthetic:20:10"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and "do not fit model resnet20 (10 classes): no entry" in line


def test_our_reader_checks_names_shapes_and_dtypes_before_reading(weights):
    template = npz.read(weights)
    wrong = dict(npz.specs_of(template))
    wrong["fc/W"] = npz.Spec((10, 513), np.dtype(np.float32))
    with pytest.raises(npz.Mismatch, match=r"'fc/W' has shape \(10, 512\), expected \(10, 513\)"):
        npz.read(weights, wrong)
    wrong["fc/W"] = npz.Spec((10, 512), np.dtype(np.float64))
    with pytest.raises(npz.Mismatch, match="'fc/W' has dtype float32, expected float64"):
        npz.read(weights, wrong)
    scalars = npz.read_bytes(npz.to_bytes({"t": np.array(3), "x": np.ones((2, 3), order="F")}), "s")
    assert scalars["t"].shape == () and scalars["x"].flags.c_contiguous


def test_a_zip_bomb_of_overlapping_members_is_refused(tmp_path):
    """Two directory entries pointing at the same deflated bytes: each looks fine alone."""
    one = io.BytesIO()
    with zipfile.ZipFile(one, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a.npy", _npy_bytes(np.zeros(1 << 16, np.float32)))
    raw = one.getvalue()
    cd = raw.index(b"PK\x01\x02")
    end = raw.index(b"PK\x05\x06")
    entry = raw[cd:end]
    twin = entry.replace(b"a.npy", b"b.npy")
    eocd = bytearray(raw[end:])
    struct.pack_into("<HHI", eocd, 8, 2, 2, len(entry) * 2)
    bomb = raw[:cd] + entry + twin + bytes(eocd)
    with pytest.raises(DataError, match="members overlap"):
        npz.read_bytes(bomb, "bomb.npz")


def _npy_bytes(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


# --- 2. pickles that declare more than they hold ------------------------------------------------


class _FakeDtype:
    def __init__(self, name="u1", state=(3, "|", None, None, None, -1, -1, 0)):
        self.name, self.state = name, state

    def __reduce__(self):
        return np.dtype, (self.name, False, True), self.state


class _FakeArray:
    """Pickles as NumPy pickles an array, with whatever shape, dtype and bytes it is given."""

    def __init__(self, shape, raw, dtype, args=(np.ndarray, (0,), b"b")):
        self.shape, self.raw, self.dtype, self.args = shape, raw, dtype, args

    def __reduce__(self):
        return _reconstruct, self.args, (1, self.shape, self.dtype, False, self.raw)


def _batch(data, labels=(0,)) -> bytes:
    return pickle.dumps({b"data": data, b"labels": list(labels)}, protocol=4)


HOSTILE_PICKLES = {
    # a terabyte of pixels over three bytes (zero strides, or an allocation that kills the driver)
    "terabyte shape": (_batch(_FakeArray((10 ** 9, 3072), b"abc", _FakeDtype())),
                       "an array of shape (1000000000, 3072) and dtype uint8 needs 3072000000000 "
                       "bytes, the file holds 3"),
    # a dtype whose declared item size exceeds the buffer: reads of the heap as pixels
    "dtype larger than its buffer": (
        _batch(_FakeArray((1, 3072), b"x" * 3072,
                          _FakeDtype("u1", (3, "|", None, None, None, 1 << 20, 1, 0)))),
        "refused dtype state in pickle"),
    "void dtype": (_batch(_FakeArray((1, 3072), b"x" * 3072, _FakeDtype("V3072"))),
                   "refused dtype 'V3072'"),
    "object dtype": (_batch(_FakeArray((1,), [1], _FakeDtype("O"))), "refused dtype 'O'"),
    "raw bytes not bytes": (_batch(_FakeArray((3,), [1, 2, 3], _FakeDtype())),
                            "refused array state"),
    "_reconstruct of another shape": (
        _batch(_FakeArray((1, 3072), b"x" * 3072, _FakeDtype(), (np.ndarray, (5,), b"b"))),
        "refused _reconstruct arguments"),
    # BINBYTES8 declaring a terabyte: the unpickler would reserve it before reading
    "BINBYTES8 of a terabyte": (b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"abc.",
                                "truncated or corrupt pickle"),
    "FRAME of a terabyte": (b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N.",
                            "truncated or corrupt pickle"),
    "labels counted before conversion": (
        _batch(_FakeArray((2, 3072), b"\0" * 6144, _FakeDtype()), labels=[0, 1, 2]),
        "3 labels for 2 images"),
    "labels that are not ints": (
        _batch(_FakeArray((2, 3072), b"\0" * 6144, _FakeDtype()), labels=[0, 10 ** 30]),
        "label at index 1 is out of range [0, 10) (31 digits)"),
}


@pytest.mark.parametrize("name", list(HOSTILE_PICKLES))
def test_hostile_pickles_are_refused_without_allocating(name):
    raw, message = HOSTILE_PICKLES[name]
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=re.escape(message)):
            cifar.parse_batch("cifar10-python", raw, "data_batch_1")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MIB, f"{name}: {peak} bytes allocated for a {len(raw)}-byte file"


def test_the_official_form_still_loads_and_owns_its_memory():
    images = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    for raw in (cifar.py2_dumps({b"data": images, b"labels": [1, 2]}),
                _batch(images, labels=(1, 2)), _batch(_FakeArray((2, 3072), images.tobytes(),
                                                                 _FakeDtype()), labels=(1, 2))):
        got, labels = cifar.parse_batch("cifar10-python", raw, "x")
        assert (got.reshape(2, -1) == images).all() and labels.tolist() == [1, 2]
        assert got.flags.writeable  # a fresh array, not a view of the file's bytes


@pytest.mark.cluster
def test_hostile_pickles_in_a_subprocess_end_with_one_line_not_a_signal(tmp_path, cifar_copy):
    """Exit 2 and one line from a real process: before, the first one ended with SIGSEGV (139)."""
    for name in ("terabyte shape", "dtype larger than its buffer"):
        (cifar_copy / "data_batch_1").write_bytes(HOSTILE_PICKLES[name][0])
        result = run_cli("inspect", "--data", str(cifar_copy))
        assert result.returncode == 2 and result.stdout == "", (name, result)
        assert "data_batch_1: " in _one_line(result.stderr)


# --- 6. every read bounded ----------------------------------------------------------------------


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]], compress=True,
         fmt=tarfile.GNU_FORMAT) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        top = tarfile.TarInfo("cifar-10-batches-py")
        top.type = tarfile.DIRTYPE
        tf.addfile(top)
        for info, body in members:
            tf.addfile(info, io.BytesIO(body))
    path.write_bytes(gzip.compress(buf.getvalue()) if compress else buf.getvalue())
    return str(path)


def _member(name: str, body: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
    info.size = len(body)
    return info, body


def _official_members(cifar_dir: str, skip=()) -> list:
    return [_member(name, (Path(cifar_dir) / name).read_bytes())
            for name in sorted(os.listdir(cifar_dir)) if name not in skip]


def _sparse_pax(tmp_path, cifar_dir) -> str:
    info = tarfile.TarInfo("cifar-10-batches-py/GNUSparseFile.0/data_batch_1")
    sparse_map = b"1\n0\n0\n".ljust(512, b"\0")
    info.size = len(sparse_map)
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                        "GNU.sparse.name": "cifar-10-batches-py/data_batch_1",
                        "GNU.sparse.realsize": str(64 << 30)}  # reads as 64 GiB of zeros
    return _tar(tmp_path / "sparse.tar.gz",
                [(info, sparse_map)] + _official_members(cifar_dir, skip={"data_batch_1"}),
                fmt=tarfile.PAX_FORMAT)


def _sparse_gnu(tmp_path, cifar_dir) -> str:
    info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
    info.type = tarfile.GNUTYPE_SPARSE
    return _tar(tmp_path / "gnusparse.tar.gz", [(info, b"")])


def _oversized_member(tmp_path, cifar_dir) -> str:
    """A header that says 1 GiB (a 3 MB gzip can hold that many zeros): refused unread."""
    info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
    info.size = 1 << 30
    path = tmp_path / "big.tar.gz"
    path.write_bytes(gzip.compress(info.tobuf(tarfile.GNU_FORMAT) + b"\0" * 4096))
    return str(path)


def _huge_pax_header(tmp_path, cifar_dir) -> str:
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = 1 << 30
    path = tmp_path / "pax.tar.gz"
    path.write_bytes(gzip.compress(info.tobuf(tarfile.USTAR_FORMAT) + b"\0" * 4096))
    return str(path)


def _duplicated(tmp_path, cifar_dir) -> str:
    members = _official_members(cifar_dir)
    second = cifar.safe_unpickle((Path(cifar_dir) / "data_batch_1").read_bytes(), "x")
    second[b"labels"] = [11] * len(second[b"labels"])  # valid in one copy, not the other
    return _tar(tmp_path / "dup.tar.gz",
                members + [_member("data_batch_1", cifar.py2_dumps(second))])


def _fifo_member_dir(tmp_path, cifar_dir) -> str:
    d = tmp_path / "fifo" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    for name in os.listdir(cifar_dir):
        if name != "data_batch_1":
            (d / name).write_bytes((Path(cifar_dir) / name).read_bytes())
    os.mkfifo(d / "data_batch_1")
    return str(d)


def _fifo_archive(tmp_path, cifar_dir) -> str:
    os.mkfifo(tmp_path / "cifar-10-python.tar.gz")
    return str(tmp_path / "cifar-10-python.tar.gz")


def _dev_zero_member(tmp_path, cifar_dir) -> str:
    d = Path(_fifo_member_dir(tmp_path, cifar_dir))
    (d / "data_batch_1").unlink()
    (d / "data_batch_1").symlink_to("/dev/zero")
    return str(d)


def _sparse_file_on_disk(tmp_path, cifar_dir) -> str:
    d = Path(_fifo_member_dir(tmp_path, cifar_dir))
    (d / "data_batch_1").unlink()
    with open(d / "data_batch_1", "wb") as f:
        f.truncate(cifar.MAX_PYTHON_BATCH_BYTES + 1)  # 200 MB of holes: no disk, no read
    return str(d)


UNBOUNDED = [
    ("sparse pax member of 64 GiB", _sparse_pax, "data_batch_1: is a sparse file"),
    ("old GNU sparse member", _sparse_gnu,
     "gnusparse.tar.gz:cifar-10-batches-py/data_batch_1: is a sparse file"),
    ("member declaring 1 GiB", _oversized_member,
     "data_batch_1: 1073741824 bytes is more than a CIFAR python batch of at most 60000 images"),
    ("pax header of 1 GiB", _huge_pax_header, "an extended tar header of 1073741824 bytes"),
    ("duplicated member", _duplicated,
     "holds cifar-10-batches-py/data_batch_1 twice"),
    ("FIFO as a batch file", _fifo_member_dir,
     "data_batch_1: is a FIFO (named pipe), expected a regular file"),
    ("FIFO as the archive", _fifo_archive,
     "cifar-10-python.tar.gz: is a FIFO (named pipe), expected a regular file"),
    ("/dev/zero as a batch file", _dev_zero_member,
     "data_batch_1: is a character device, expected a regular file"),
    ("a 200 MB sparse batch file", _sparse_file_on_disk,
     "data_batch_1: 199680001 bytes is more than a CIFAR python batch"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make, message", [u[1:] for u in UNBOUNDED], ids=[u[0] for u in UNBOUNDED])
def test_unbounded_reads_are_refused_before_reading(tmp_path, cifar_dir, make, message):
    source = make(tmp_path, cifar_dir)
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as err:
            data.load_dataset(source)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert peak < 64 * MIB, peak  # the good members of the archive, never the declared size


def test_synthetic_sizes_are_bounded(capsys):
    rc = main(["inspect", "--data", "synthetic:1000000000000:1"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and "asks for more images than a CIFAR set of files holds" in line
    with pytest.raises(ValueError, match="n_train must be <= 300000"):
        cifar.write_synthetic("/nonexistent", n_train=300_001)
