"""The CIFAR file formats: find, read and validate the official batches, write them, and draw synthetic ones.

Pure format code (no dask): the graph builder in ``pipeline.data.datasets`` ships :func:`load` to workers.

Formats (https://www.cs.toronto.edu/~kriz/cifar.html):

* CIFAR-10 python, ``cifar-10-batches-py/``: ``data_batch_1`` .. ``data_batch_5``, ``test_batch``
  and ``batches.meta``, each a Python 2 pickle (protocol 2) of a dict with bytes keys. A batch
  holds ``b'data'`` (uint8 ``(N, 3072)``, rows are R then G then B planes of 32x32),
  ``b'labels'`` (list of int), ``b'batch_label'`` and ``b'filenames'``.
* CIFAR-10 binary, ``cifar-10-batches-bin/``: ``data_batch_1.bin`` .. ``test_batch.bin`` of
  3073-byte records (one label byte, then the 3072 image bytes) and ``batches.meta.txt``.
* CIFAR-100 python, ``cifar-100-python/``: ``train``, ``test`` and ``meta`` pickles with
  ``b'fine_labels'`` (100 classes) and ``b'coarse_labels'`` (20).

The pickles are read with a restricted unpickler that resolves only numpy's array
reconstruction globals: anything else is refused before it can run.
"""
from __future__ import annotations

import dataclasses
import gzip
import io
import math
import os
import pickle
import pickletools
import struct
import tarfile
import zlib
from typing import NamedTuple

import numpy as np

from pipeline.core import errors
from pipeline.core.errors import DataError
from pipeline.core.files import check_size, open_regular, read_capped
from pipeline.core.rng import rng_for

IMAGE_SHAPE = (3, 32, 32)
IMAGE_BYTES = 3 * 32 * 32
RECORD_BYTES = 1 + IMAGE_BYTES  # binary version: one label byte, then the image
# The largest official file holds 50,000 images (CIFAR-100's train); we allow all 60,000 images
# of CIFAR-10 in one file. Reads are capped by what a file of that many images can be, so a
# huge, sparse or endless file is refused before it is read.
MAX_IMAGES_PER_FILE = 60_000
_PICKLE_OVERHEAD = 256  # bytes per image besides its pixels: labels, a file name, opcodes (~60)
MAX_PYTHON_BATCH_BYTES = MAX_IMAGES_PER_FILE * (IMAGE_BYTES + _PICKLE_OVERHEAD)
MAX_BINARY_BATCH_BYTES = MAX_IMAGES_PER_FILE * RECORD_BYTES
MAX_META_BYTES = 1 << 20  # 10 or 120 class names; the official meta files are < 2 KB
_MAX_TAR_HEADER = 64 << 10  # a pax or GNU long-name header; ours and the official ones are none
_MAX_TAR_TRAILER = 1 << 20  # zero padding after the end-of-archive blocks (tar pads to 10 KiB)
TRAIN_BATCHES = 5  # CIFAR-10 splits its 50,000 training images over five batch files
CIFAR10_LABEL_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                       "ship", "truck")
SPLITS = {"train": 0, "test": 1}  # split ids in the synthetic generator's RNG coordinates


@dataclasses.dataclass(frozen=True)
class Layout:
    """The files of one official format."""
    key: str  # "cifar10-python" | "cifar10-binary" | "cifar100-python"
    top: str  # directory name, inside the official archive and when extracted
    archive: str  # official archive file name
    train: tuple[str, ...]  # training batch files, in order
    test: tuple[str, ...]  # test batch files
    meta: str  # the file with the label names
    optional: tuple[str, ...]  # files the official archive also holds


LAYOUTS = {
    "cifar10-python": Layout("cifar10-python", "cifar-10-batches-py", "cifar-10-python.tar.gz",
                             tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",),
                             "batches.meta", ("readme.html",)),
    "cifar10-binary": Layout("cifar10-binary", "cifar-10-batches-bin", "cifar-10-binary.tar.gz",
                             tuple(f"data_batch_{i}.bin" for i in range(1, 6)), ("test_batch.bin",),
                             "batches.meta.txt", ("readme.html",)),
    "cifar100-python": Layout("cifar100-python", "cifar-100-python", "cifar-100-python.tar.gz",
                              ("train",), ("test",), "meta", ("file.txt~",)),
}


@dataclasses.dataclass(frozen=True)
class BatchFile:
    """One batch file, enough for any worker that sees the same path to read it."""
    layout: str  # key of LAYOUTS
    path: str  # the batch file, or the tarball that holds it
    member: str | None = None  # member name inside the tarball; None for a plain file
    label_kind: str = "fine"  # CIFAR-100 only: "fine" or "coarse" labels
    n: int = -1  # images found when the source was scanned (-1: not scanned); load() checks it

    @property
    def where(self) -> str:
        """How errors name this file: ``path`` or ``archive:member``."""
        return f"{self.path}:{self.member}" if self.member else self.path


@dataclasses.dataclass(frozen=True)
class SyntheticChunk:
    """One chunk of the synthetic dataset: made on whichever worker runs it, same bytes everywhere."""
    seed: int  # data seed
    split: str  # "train" | "test"
    index: int  # chunk number within the split (the batch file number minus one)
    n: int  # images in the chunk


class Catalog(NamedTuple):
    """What a scan of a CIFAR source found; every batch file was read once and validated."""
    layout: str  # key of LAYOUTS
    train: tuple[BatchFile, ...]  # training batch files with their image counts
    test: tuple[BatchFile, ...]
    label_names: tuple[str, ...]
    class_counts_train: tuple[int, ...]  # training images per class
    stamp: tuple  # (path, size, mtime_ns) of every file read: same stamp, same data


# --------------------------------------------------------------------------------------------
# The load- task


def load(chunk: BatchFile | SyntheticChunk) -> tuple[np.ndarray, np.ndarray]:
    """The ``load-`` task: one batch file (or synthetic chunk) -> images and labels.

    Returns images ``(n, 3, 32, 32) uint8`` and labels ``(n,) int32``, read in one pass.

    >>> images, labels = load(SyntheticChunk(seed=0, split="train", index=0, n=4))
    >>> images.shape, images.dtype, labels.dtype
    ((4, 3, 32, 32), dtype('uint8'), dtype('int32'))
    """
    if isinstance(chunk, SyntheticChunk):
        return synthetic_batch(chunk.seed, chunk.split, chunk.index, chunk.n)
    lay = LAYOUTS[chunk.layout]
    if chunk.member is None:
        raw = _read_file(chunk.path, lay)
    else:
        raw = _read_archive(chunk.path, {chunk.member})[1].get(chunk.member)
        if raw is None:
            raise DataError(f"{chunk.where}: missing from the archive")
    images, labels = parse_batch(chunk.layout, raw, chunk.where, chunk.label_kind)
    if chunk.n >= 0 and len(labels) != chunk.n:
        raise DataError(f"{chunk.where}: holds {len(labels)} images but held {chunk.n} when the "
                        "dataset was opened (the file changed)")
    return images, labels


# --------------------------------------------------------------------------------------------
# Finding and scanning a source


def scan(path: str, label_kind: str = "fine", prefer: str = "cifar10") -> Catalog:
    """Find the CIFAR data at ``path``, read every batch once, validate it, and count it.

    ``path`` is an official tarball (read in place, never extracted), an extracted
    ``cifar-10-batches-py/``, ``cifar-10-batches-bin/`` or ``cifar-100-python/`` directory, or a
    directory holding one of those or an official tarball. ``prefer`` ("cifar10"/"cifar100") picks
    when a directory holds several. Raises DataError naming the file and the problem.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        kind, where, layout = locate(path, prefer)
        if kind == "dir":
            return _scan_dir(where, LAYOUTS[layout], label_kind)
        path = where
    return _scan_archive(path, label_kind)


def locate(path: str, prefer: str = "cifar10") -> tuple[str, str, str | None]:
    """Where the data in directory ``path`` is: ``("dir", directory, layout key)`` or
    ``("archive", tarball, None)``; DataError when there is none."""
    order = sorted(LAYOUTS.values(), key=lambda lay: not lay.key.startswith(prefer + "-"))
    for lay in order:
        if os.path.basename(path) == lay.top:
            return "dir", path, lay.key
    for lay in order:
        if os.path.isdir(os.path.join(path, lay.top)):
            return "dir", os.path.join(path, lay.top), lay.key
    for lay in order:
        if os.path.isfile(os.path.join(path, lay.archive)):
            return "archive", os.path.join(path, lay.archive), None
    for lay in order:  # a renamed extracted directory: recognise it by its files
        if any(os.path.exists(os.path.join(path, name)) for name in (lay.meta, lay.train[0])):
            return "dir", path, lay.key
    raise DataError(f"{path}: no CIFAR data here (expected cifar-10-batches-py/, "
                    "cifar-10-batches-bin/, cifar-100-python/ or an official .tar.gz)")


def _check_names(where: str, lay: Layout, names: set[str]) -> None:
    """Missing or unexpected files of a layout (dotfiles and editor backups ``*~`` are let be)."""
    required = (*lay.train, *lay.test, lay.meta)
    missing = [name for name in required if name not in names]
    if missing:
        raise DataError(f"{where}: missing {', '.join(missing)} ({lay.top} holds "
                        f"{', '.join(required)})")
    extra = sorted(name for name in names if name not in required and name not in lay.optional
                   and not name.startswith(".") and not name.endswith("~"))
    if extra:
        listed = ", ".join(n[:80] for n in extra[:8]) + (", ..." if len(extra) > 8 else "")
        raise DataError(f"{where}: unexpected file(s) {listed} ({lay.top} holds only "
                        f"{', '.join((*required, *lay.optional))})")


def _scan_dir(directory: str, lay: Layout, label_kind: str) -> Catalog:
    try:
        names = set(os.listdir(directory))
    except OSError as exc:
        raise DataError(f"{directory}: cannot list the directory ({one_line(exc)})") from None
    _check_names(directory, lay, names)
    paths = {name: os.path.join(directory, name) for name in (*lay.train, *lay.test, lay.meta)}
    files = {name: BatchFile(lay.key, path, None, label_kind) for name, path in paths.items()}
    catalog = _catalog(lay, lambda name: _read_file(paths[name], lay), files, (), label_kind)
    return catalog._replace(stamp=tuple(_stamp(path) for path in paths.values()))


def _scan_archive(path: str, label_kind: str) -> Catalog:
    top, members, seen = _read_archive(path, None)
    lay = _layout_of_top(top)
    if lay is None:
        raise DataError(f"{path}: the archive holds {top[:80]}/, not cifar-10-batches-py/, "
                        "cifar-10-batches-bin/ or cifar-100-python/")
    names = {name.split("/", 1)[1] for name in seen if "/" in name}
    _check_names(path, lay, names)
    raw = {name.split("/", 1)[1]: data for name, data in members.items()}
    files = {name: BatchFile(lay.key, path, f"{top}/{name}", label_kind) for name in raw}
    return _catalog(lay, raw.pop, files, (_stamp(path),), label_kind)


def _catalog(lay: Layout, read, files: dict, stamp: tuple, label_kind: str) -> Catalog:
    """Parse and count every batch; ``read(name) -> bytes`` gives one file at a time."""
    names = parse_meta(lay.key, read(lay.meta), files[lay.meta].where, label_kind)
    counted = {}
    for name in (*lay.train, *lay.test):
        _, labels = parse_batch(lay.key, read(name), files[name].where, label_kind)
        counted[name] = (dataclasses.replace(files[name], n=len(labels)),
                         np.bincount(labels, minlength=len(names)))
    counts = sum(counted[name][1] for name in lay.train)
    return Catalog(lay.key, tuple(counted[name][0] for name in lay.train),
                   tuple(counted[name][0] for name in lay.test), names,
                   tuple(int(c) for c in counts), stamp)


# --------------------------------------------------------------------------------------------
# Reading bytes


def one_line(exc: BaseException) -> str:
    """One line from an exception (``errors.one_line`` without the type, at most 200 chars)."""
    return errors.one_line(exc, kind=False, limit=200)


def _stamp(path: str) -> tuple:
    st = os.stat(path)
    return path, st.st_size, st.st_mtime_ns


def limit_of(lay: Layout, name: str) -> tuple[int, str]:
    """(most bytes, what it is) that file ``name`` of layout ``lay`` may hold.

    >>> limit_of(LAYOUTS["cifar10-binary"], "test_batch.bin")
    (184380000, 'a CIFAR binary batch of at most 60000 images')
    """
    if name == lay.meta:
        return MAX_META_BYTES, "a CIFAR meta file"
    if lay.key == "cifar10-binary":
        return MAX_BINARY_BATCH_BYTES, f"a CIFAR binary batch of at most {MAX_IMAGES_PER_FILE} images"
    return MAX_PYTHON_BATCH_BYTES, f"a CIFAR python batch of at most {MAX_IMAGES_PER_FILE} images"


def _read_file(path: str, lay: Layout) -> bytes:
    """All bytes of a regular file, at most what its format allows; one-line errors."""
    return read_capped(path, *limit_of(lay, os.path.basename(path)))


def _layout_of_top(top: str) -> Layout | None:
    return next((lay for lay in LAYOUTS.values() if lay.top == top), None)


class _MemberError(DataError):
    """A problem with one tar member, raised where the archive's path is not known."""


class _CappedTarInfo(tarfile.TarInfo):
    """Refuses, before tarfile reads them whole into memory, pax and GNU long-name headers larger
    than any real archive has, and old-style GNU sparse members (a small sparse member can
    expand to terabytes)."""

    def _proc_member(self, tarfile_):  # tarfile's documented hook for member processing
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _MemberError(f"{self.name[:80]}: is a sparse file, not a regular file")
        if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
                         tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK) \
                and self.size > _MAX_TAR_HEADER:
            raise DataError(f"an extended tar header of {self.size} bytes (at most "
                            f"{_MAX_TAR_HEADER})")
        return super()._proc_member(tarfile_)


def _read_archive(path: str, wanted: set[str] | None
                  ) -> tuple[str, dict[str, bytes], set[str]]:
    """(top directory, {member name: bytes}, every member name) of a tarball, in one sequential
    pass, never extracted.

    ``wanted=None`` reads every file of the layout that the top directory names and checks the
    whole archive: members elsewhere, nested directories, links, sparse files and a name twice
    are errors, as is a member larger than its format allows (checked before it is read).
    """
    f = open_regular(path)
    top, out, seen = None, {}, set()
    try:
        with f, tarfile.open(fileobj=f, mode="r:*", tarinfo=_CappedTarInfo) as tar:
            for member in tar:
                name = member.name.removeprefix("./").rstrip("/")
                head, _, rest = name.partition("/")
                top = head if top is None else top
                if head != top or "/" in rest:
                    raise DataError(f"{path}: unexpected member {member.name[:80]} (an official "
                                    f"archive holds only the files of {top}/)")
                if name in seen:
                    raise DataError(f"{path}: holds {name} twice (an archive with a duplicated "
                                    "member is refused: which copy counts is ambiguous)")
                seen.add(name)
                _check_member(path, name, member, _layout_of_top(top), wanted)
                if not rest or (wanted is not None and name not in wanted) or \
                        not _needed(_layout_of_top(top), rest):
                    continue
                out[name] = _member_bytes(tar, member, path, name)
                if wanted is not None and wanted <= out.keys():
                    break  # a load- task needs one member: stop decompressing
            if wanted is None:
                _check_archive_end(tar, path)
    except DataError as exc:
        text = str(exc)
        raise DataError(f"{path}:{text}" if isinstance(exc, _MemberError) else
                        text if text.startswith(path) else f"{path}: {text}") from None
    except MemoryError:
        raise DataError(f"{path}: not enough memory to read the archive") from None
    except (tarfile.TarError, EOFError, OSError, zlib.error, ValueError) as exc:
        raise DataError(f"{path}: corrupt, truncated or not a tar archive "
                        f"({one_line(exc)})") from None
    if top is None:
        raise DataError(f"{path}: the archive is empty")
    return top, out, seen


def _check_member(path: str, name: str, member: tarfile.TarInfo, lay: Layout | None,
                  wanted) -> None:
    """What can be refused from a member's header alone, before its data is read."""
    if member.issparse():
        raise DataError(f"{path}:{name}: is a sparse file, not a regular file")
    if lay is None or "/" not in name:
        return
    base = name.split("/", 1)[1]
    if _needed(lay, base) and (wanted is None or name in wanted):
        if not member.isfile():
            raise DataError(f"{path}:{name}: is not a regular file")
        limit, what = limit_of(lay, base)
        check_size(f"{path}:{name}", member.size, limit, what)


def _needed(lay: Layout | None, base: str) -> bool:
    """Whether a member's bytes are read: the layout's batches and meta file (not the readme)."""
    return lay is not None and base in (*lay.train, *lay.test, lay.meta)


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo, path: str, name: str) -> bytes:
    data = tar.extractfile(member).read(member.size + 1)
    if len(data) != member.size:
        raise DataError(f"{path}:{name}: holds {len(data)} bytes, its header says {member.size}")
    return data


def _check_archive_end(tar: tarfile.TarFile, path: str) -> None:
    """Corruption tarfile lets pass: it ends the member list silently at a garbled header, and
    gzip verifies its CRC only at the end of the stream. Padding after the end is capped."""
    tar.fileobj.seek(tar.offset)  # where iteration stopped: must be the zero end-of-archive block
    if tar.fileobj.read(tarfile.BLOCKSIZE).strip(b"\0"):
        raise DataError(f"{path}: corrupt, truncated or not a tar archive (invalid tar header at "
                        f"byte {tar.offset})")
    trailer = 0
    while block := tar.fileobj.read(1 << 16):  # to the end, so gzip/bz2/xz check integrity
        trailer += len(block)
        if trailer > _MAX_TAR_TRAILER or block.strip(b"\0"):
            raise DataError(f"{path}: unexpected data after the end of the tar archive")


# --------------------------------------------------------------------------------------------
# Parsing and validating


# The official pickles hold each array as three calls: _reconstruct(ndarray, (0,), b"b") makes an
# empty array, numpy.dtype("u1", 0, 1) a dtype, and BUILD sets the array's state (shape, dtype,
# raw bytes) and the dtype's (byte order). Letting the pickle call NumPy's own ndarray and dtype
# lets a 200-byte file declare a terabyte array over a few bytes, or a dtype larger than its
# buffer: reads of memory nobody allocated. So the unpickler resolves those names to stand-ins
# that only record what the file says; the array is then built by us, from a dtype on a short
# list, with a shape whose size equals the bytes actually present.
_DTYPES = {f"{kind}{size}" for kind, sizes in (("u", "1248"), ("i", "1248"), ("f", "248"))
           for size in sizes} | {"b1"}
_MAX_NDIM = 4  # a batch's data is 2-d, its labels 1-d


class _NdarrayName:
    """What ``numpy.ndarray`` resolves to in a CIFAR pickle: a name, never called."""


class _PendingArray:
    """What ``_reconstruct`` returns: an array to be, built when BUILD gives its state."""

    def __init__(self, where: str):
        self.where, self.array = where, None

    def __setstate__(self, state):
        self.array = _array_from_state(state, self.where)


class _DtypeSpec:
    """What ``numpy.dtype(name, align, copy)`` returns: a checked name, then a byte order."""

    def __init__(self, where: str, name):
        name = _text(name)
        if name not in _DTYPES:
            raise DataError(f"{where}: refused dtype {str(name)[:20]!r} in pickle (a CIFAR batch "
                            "holds only plain integer or float arrays)")
        self.where, self.name, self.order = where, name, "|" if name in ("u1", "i1", "b1") else "<"

    def __setstate__(self, state):
        # (version, byte order, subarray, names, fields, elsize, alignment, flags); the official
        # files and NumPy 2's pickles say (3, order, None, None, None, -1, -1, 0).
        if not (isinstance(state, tuple) and len(state) == 8 and state[0] in (3, 4)
                and _text(state[1]) in ("<", ">", "|", "=") and state[2:5] == (None,) * 3
                and state[5] in (-1, np.dtype(self.name).itemsize)
                and state[6] in (-1, np.dtype(self.name).alignment) and state[7] == 0):
            raise DataError(f"{self.where}: refused dtype state in pickle (not a plain "
                            f"{self.name} array)")
        order = _text(state[1])
        self.order = "<" if order == "=" and np.little_endian else order

    def dtype(self) -> np.dtype:
        order = "|" if self.name in ("u1", "i1", "b1") else (">" if self.order == ">" else "<")
        return np.dtype(order + self.name)


def _text(value):
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _array_from_state(state, where: str) -> np.ndarray:
    """``ndarray.__setstate__``'s (version, shape, dtype, fortran, raw bytes), checked, as a
    fresh array owning exactly the bytes the file holds."""
    if not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1):
        raise DataError(f"{where}: refused array state in pickle (not a plain array)")
    _, shape, spec, fortran, raw = state
    if not (isinstance(shape, tuple) and len(shape) <= _MAX_NDIM
            and all(type(n) is int and 0 <= n for n in shape)):
        raise DataError(f"{where}: refused array shape {str(shape)[:60]} in pickle")
    if not isinstance(spec, _DtypeSpec) or type(fortran) is not bool or \
            not isinstance(raw, (bytes, bytearray)):
        raise DataError(f"{where}: refused array state in pickle (not a plain array)")
    dtype = spec.dtype()
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != len(raw):
        raise DataError(f"{where}: an array of shape {shape} and dtype {dtype} needs {nbytes} "
                        f"bytes, the file holds {len(raw)}")
    array = np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    return np.array(array, dtype=dtype.newbyteorder("="), order="C")  # a writable copy


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals the official batches need, to stand-ins; anything else is
    refused, unrun."""

    GLOBALS = {
        ("numpy.core.multiarray", "_reconstruct"),  # files written by NumPy 1 / Python 2
        ("numpy._core.multiarray", "_reconstruct"),  # files re-pickled by NumPy 2
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def __init__(self, file, where: str):
        super().__init__(file, encoding="bytes")  # Python 2 str -> bytes, as the format intends
        self.where = where

    def find_class(self, module, name):
        if (module, name) not in self.GLOBALS:
            raise DataError(f"{self.where}: refused pickle global {module}.{name} (a CIFAR batch "
                            "needs only numpy array reconstruction; nothing was run)")
        if name == "ndarray":
            return _NdarrayName
        if name == "dtype":
            return lambda dtype, align=False, copy=False: _DtypeSpec(self.where, dtype)
        return self._reconstruct

    def _reconstruct(self, cls, shape, typecode):
        if cls is not _NdarrayName or shape != (0,) or typecode not in (b"b", "b"):
            raise DataError(f"{self.where}: refused _reconstruct arguments in pickle (not an "
                            "array of the official form)")
        return _PendingArray(self.where)

    def persistent_load(self, pid):
        raise DataError(f"{self.where}: refused persistent id in pickle (not a CIFAR batch)")


def _check_opcodes(raw: bytes, where: str) -> None:
    """Walk the opcodes once without running them: every length a string, bytes or frame opcode
    declares must be present, so the unpickler never allocates more than the file holds
    (BINBYTES8 would reserve its declared size first); buffers out of band are refused."""
    try:
        for op, _, _ in pickletools.genops(raw):
            if op.name in ("NEXT_BUFFER", "READONLY_BUFFER"):
                raise DataError(f"{where}: refused out-of-band buffer in pickle")
    except DataError:
        raise
    except Exception as exc:  # ValueError: truncated argument or unknown opcode
        raise DataError(f"{where}: truncated or corrupt pickle ({type(exc).__name__}: "
                        f"{one_line(exc)})") from None


def _resolve(obj):
    """The unpickled object with every built array in place of its stand-in (dict values and
    list items of the top level: where a batch keeps its arrays)."""
    if isinstance(obj, _PendingArray):
        if obj.array is None:
            raise DataError(f"{obj.where}: an array without its state in pickle")
        return obj.array
    if isinstance(obj, dict):
        return {k: _resolve_leaf(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_resolve_leaf(v) for v in obj]
    return obj


def _resolve_leaf(value):
    return _resolve(value) if isinstance(value, _PendingArray) else value


def safe_unpickle(raw: bytes, where: str):
    """Unpickle a CIFAR python file with the restricted unpickler (bytes keys stay bytes).

    >>> safe_unpickle(py2_dumps({b"labels": [1, 2]}), "x")
    {b'labels': [1, 2]}
    >>> safe_unpickle(pickle.dumps(print, protocol=4), "x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    pipeline.core.errors.DataError: x: refused pickle global builtins.print (...; nothing was run)
    """
    if not raw:
        raise DataError(f"{where}: the file is empty")
    _check_opcodes(raw, where)
    try:
        return _resolve(_RestrictedUnpickler(io.BytesIO(raw), where).load())
    except DataError:
        raise
    except MemoryError:
        raise DataError(f"{where}: not enough memory to unpickle it") from None
    except Exception as exc:  # UnpicklingError, EOFError, TypeError from a bad call, ...
        raise DataError(f"{where}: truncated or corrupt pickle ({type(exc).__name__}: "
                        f"{one_line(exc)})") from None


def _as_dict(obj, where: str) -> dict[str, object]:
    """A batch dict with text keys (bytes keys in the official files, str if re-pickled)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: holds a {type(obj).__name__}, expected a dict")
    return {k.decode("latin-1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def _check_images(data, where: str) -> np.ndarray:
    """``(N, 3072) uint8`` batch data -> ``(N, 3, 32, 32) uint8`` images, or DataError."""
    if not isinstance(data, np.ndarray):
        raise DataError(f"{where}: data is a {type(data).__name__}, expected a uint8 array of "
                        f"shape (N, {IMAGE_BYTES})")
    if data.dtype != np.uint8:
        raise DataError(f"{where}: data has dtype {data.dtype}, expected uint8")
    if data.ndim != 2 or data.shape[1] != IMAGE_BYTES:
        raise DataError(f"{where}: data has shape {data.shape}, expected (N, {IMAGE_BYTES})")
    if data.shape[0] == 0:
        raise DataError(f"{where}: holds no images (data is empty)")
    return np.ascontiguousarray(data).reshape(-1, *IMAGE_SHAPE)


def _check_labels(labels, n: int, n_classes: int, where: str) -> np.ndarray:
    """A list or 1-d array of n class ids in [0, n_classes) -> ``(n,) int32``, or DataError."""
    if not isinstance(labels, (list, tuple, np.ndarray)):
        raise DataError(f"{where}: labels are a {type(labels).__name__}, expected a list of int")
    count = labels.size if isinstance(labels, np.ndarray) else len(labels)
    if count != n or (isinstance(labels, np.ndarray) and labels.ndim != 1):
        raise DataError(f"{where}: {count} labels for {n} images (label/data count mismatch)")
    if isinstance(labels, np.ndarray):  # counted first: nothing is converted before it fits
        arr = labels
    else:
        odd = next((i for i, x in enumerate(labels) if type(x) is not int
                    or not -2**31 <= x < 2**31), None)
        if odd is not None and type(labels[odd]) is not int:
            raise DataError(f"{where}: labels must be integers, found "
                            f"{type(labels[odd]).__name__} {repr(labels[odd])[:20]}")
        if odd is not None:
            raise DataError(f"{where}: label at index {odd} is out of range [0, {n_classes}) "
                            f"({len(str(abs(labels[odd])))} digits)")
        arr = np.array(labels, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise DataError(f"{where}: labels have dtype {arr.dtype}, expected integers")
    bad = np.flatnonzero((arr < 0) | (arr >= n_classes))
    if bad.size:
        raise DataError(f"{where}: label {arr[bad[0]]} at index {bad[0]} is out of range "
                        f"[0, {n_classes})")
    return arr.astype(np.int32)


def parse_batch(layout: str, raw: bytes, where: str, label_kind: str = "fine"
                ) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of one batch file -> validated images ``(n, 3, 32, 32) uint8``, labels ``(n,) int32``.

    Raises DataError naming ``where`` for anything but a well-formed batch of the layout.
    """
    if layout == "cifar10-binary":
        return _parse_binary(raw, where)
    batch = _as_dict(safe_unpickle(raw, where), where)
    key, n_classes = ("labels", 10) if layout == "cifar10-python" else \
        (f"{label_kind}_labels", 100 if label_kind == "fine" else 20)
    for name in ("data", key):
        if name not in batch:
            raise DataError(f"{where}: has no {name!r} entry (keys: "
                            f"{', '.join(sorted(batch)) or 'none'})")
    images = _check_images(batch["data"], where)
    return images, _check_labels(batch[key], len(images), n_classes, where)


def _parse_binary(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    if not raw:
        raise DataError(f"{where}: holds no images (the file is empty)")
    if len(raw) % RECORD_BYTES:
        raise DataError(f"{where}: {len(raw)} bytes is not a whole number of {RECORD_BYTES}-byte "
                        "records (truncated, or not a CIFAR-10 binary batch)")
    records = np.frombuffer(raw, np.uint8).reshape(-1, RECORD_BYTES)
    labels = _check_labels(records[:, 0], len(records), 10, where)
    return np.ascontiguousarray(records[:, 1:]).reshape(-1, *IMAGE_SHAPE), labels


def parse_meta(layout: str, raw: bytes, where: str, label_kind: str = "fine") -> tuple[str, ...]:
    """The bytes of the meta file -> class names (10, or 100 fine / 20 coarse for CIFAR-100)."""
    if layout == "cifar10-binary":
        names = [line.strip() for line in raw.decode("utf-8", "replace").splitlines()]
        names, key, expected = [n for n in names if n], "lines", 10
    else:
        meta = _as_dict(safe_unpickle(raw, where), where)
        key, expected = ("label_names", 10) if layout == "cifar10-python" else \
            (f"{label_kind}_label_names", 100 if label_kind == "fine" else 20)
        names = meta.get(key)
        if not isinstance(names, (list, tuple)) or \
                not all(isinstance(n, (bytes, str)) for n in names):
            raise DataError(f"{where}: has no {key!r} list of names")
        names = [n.decode("utf-8", "replace") if isinstance(n, bytes) else n for n in names]
    if len(names) != expected:
        raise DataError(f"{where}: {len(names)} class names in {key}, expected {expected}")
    return tuple(names)


# --------------------------------------------------------------------------------------------
# Synthetic data


def split_sizes(n: int, parts: int) -> list[int]:
    """n items over ``parts`` chunks as equal as possible, larger first (like np.array_split).

    >>> split_sizes(11, 5)
    [3, 2, 2, 2, 2]
    """
    return [n // parts + (i < n % parts) for i in range(parts)]


# Class c draws shape c % 5 in colour family c // 5: neither shape nor colour alone tells the
# class, and colour jitter, a random background, placement, size and noise keep it from being
# trivially separable (a small CNN gets well above chance in an epoch on 5,000 images).
def _disk(dy, dx, r):
    """Offsets ``(k, 32, 32)`` from each image's centre and radii ``(k, 1, 1)`` -> mask."""
    return dy * dy + dx * dx <= r * r


def _square(dy, dx, r):
    return np.maximum(np.abs(dy), np.abs(dx)) <= 0.8 * r


def _ring(dy, dx, r):
    dist2 = dy * dy + dx * dx
    return (dist2 <= r * r) & (dist2 >= (0.55 * r) ** 2)


def _stripes(dy, dx, r):  # horizontal bars 2 px wide inside the square
    return (np.maximum(np.abs(dy), np.abs(dx)) <= r) & (np.floor(dy / 2) % 2 == 0)


def _cross(dy, dx, r):
    return (np.maximum(np.abs(dy), np.abs(dx)) <= r) & ((np.abs(dy) <= r / 3) |
                                                        (np.abs(dx) <= r / 3))


_SHAPES = (_disk, _square, _ring, _stripes, _cross)
_FAMILIES = np.array([[200, 90, 60], [60, 110, 200]], np.float32)  # warm / cool mean RGB
_YY, _XX = np.mgrid[0:32, 0:32].astype(np.float32)


def synthetic_labels(seed: int, split: str, index: int, n: int) -> np.ndarray:
    """The labels of synthetic chunk ``index`` of ``split``: ``(n,) int32``, balanced over 10 classes.

    The first draw of the chunk's generator, so they equal ``synthetic_batch(...)[1]``.

    >>> synthetic_labels(0, "train", 0, 20).tolist().count(3)
    2
    """
    rng = rng_for(seed, "synthetic", SPLITS[split], index)
    return rng.permutation(np.arange(n) % 10).astype(np.int32)


def synthetic_batch(seed: int, split: str, index: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk ``index`` of ``split`` of the synthetic dataset.

    Returns images ``(n, 3, 32, 32) uint8`` and labels ``(n,) int32``. Pure: the same arguments
    give the same bytes on any worker (the generator is ``rng_for(seed, "synthetic", split,
    index)``).

    >>> a, la = synthetic_batch(0, "test", 0, 8)
    >>> b, lb = synthetic_batch(0, "test", 0, 8)
    >>> bool((a == b).all() and (la == lb).all()), a.shape
    (True, (8, 3, 32, 32))
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {tuple(SPLITS)}, got {split!r}")
    rng = rng_for(seed, "synthetic", SPLITS[split], index)
    labels = rng.permutation(np.arange(n) % 10).astype(np.int32)
    return render(labels, rng), labels


def render(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Class ids ``(n,) int`` -> images ``(n, 3, 32, 32) uint8`` drawn with ``rng``."""
    n = len(labels)
    background = rng.uniform(0, 255, (n, 3)).astype(np.float32)
    foreground = _FAMILIES[labels // 5] + rng.normal(0, 45, (n, 3)).astype(np.float32)
    centre = rng.uniform(9, 23, (n, 2)).astype(np.float32)
    radius = rng.uniform(5, 11, n).astype(np.float32)
    mask = np.empty((n, 1, 32, 32), bool)
    for shape, draw in enumerate(_SHAPES):  # loop over the five shapes, never over images
        picked = np.flatnonzero(labels % 5 == shape)
        mask[picked, 0] = draw(_YY - centre[picked, 0, None, None],
                               _XX - centre[picked, 1, None, None], radius[picked, None, None])
    images = np.where(mask, foreground[:, :, None, None], background[:, :, None, None])
    images += rng.normal(0, 24, images.shape).astype(np.float32)
    return np.clip(images, 0, 255).round().astype(np.uint8)


def _synthetic_batches(n_train: int, n_test: int, seed: int):
    train = [synthetic_batch(seed, "train", i, n)
             for i, n in enumerate(split_sizes(n_train, TRAIN_BATCHES))]
    return train, synthetic_batch(seed, "test", 0, n_test)


def write_synthetic(out: str, n_train: int = 5000, n_test: int = 1000, seed: int = 0,
                    tar: bool = False, fmt: str = "python") -> str:
    """Write a synthetic CIFAR-10 in the official format under ``out``; return the path for ``--data``.

    ``fmt="python"`` writes ``out/cifar-10-batches-py/`` (five training batches, as equal as
    possible, plus ``test_batch``, ``batches.meta`` and ``readme.html``), byte-compatible with the
    official pickles; ``fmt="binary"`` writes ``out/cifar-10-batches-bin/``. With ``tar=True`` also
    the official archive (``cifar-10-python.tar.gz`` / ``cifar-10-binary.tar.gz``) beside it. The
    content equals the on-the-fly ``synthetic:n_train:n_test`` source of the same seed.
    """
    if n_train < TRAIN_BATCHES:
        raise ValueError(f"n_train must be >= {TRAIN_BATCHES} (one image per batch file), "
                         f"got {n_train}")
    if n_train > TRAIN_BATCHES * MAX_IMAGES_PER_FILE:
        raise ValueError(f"n_train must be <= {TRAIN_BATCHES * MAX_IMAGES_PER_FILE} (five "
                         f"files of at most {MAX_IMAGES_PER_FILE} images), got {n_train}")
    if n_test < 1:
        raise ValueError(f"n_test must be >= 1, got {n_test}")
    if n_test > MAX_IMAGES_PER_FILE:
        raise ValueError(f"n_test must be <= {MAX_IMAGES_PER_FILE} (one file), got {n_test}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if fmt not in ("python", "binary"):
        raise ValueError(f"fmt must be python or binary, got {fmt!r}")
    train, test = _synthetic_batches(n_train, n_test, seed)
    writer = write_python10 if fmt == "python" else write_binary10
    return writer(out, train, test, CIFAR10_LABEL_NAMES, tar=tar)


# --------------------------------------------------------------------------------------------
# Writing the official formats


_README = (b'<meta HTTP-EQUIV="REFRESH" content="0; '
           b'url=http://www.cs.toronto.edu/~kriz/cifar.html">\n')
# Member order of the official archives (tarfile lists them so).
_TAR_ORDER = {
    "cifar10-python": ("data_batch_4", "readme.html", "test_batch", "data_batch_3", "batches.meta",
                       "data_batch_2", "data_batch_5", "data_batch_1"),
    "cifar10-binary": ("data_batch_1.bin", "batches.meta.txt", "data_batch_3.bin",
                       "data_batch_4.bin", "test_batch.bin", "readme.html", "data_batch_2.bin",
                       "data_batch_5.bin"),
    "cifar100-python": ("file.txt~", "train", "test", "meta"),
}


def _filenames(labels: np.ndarray, names, start: int) -> list[bytes]:
    return [f"synthetic_{names[c] if 0 <= c < len(names) else c}_s_{start + i:06d}.png".encode()
            for i, c in enumerate(labels)]


def write_python10(out: str, train, test, label_names, tar: bool = False) -> str:
    """Write ``out/cifar-10-batches-py/`` from ``[(images, labels)] * k`` and ``(images, labels)``."""
    files, start = {}, 0
    for i, (images, labels) in enumerate(train):
        files[f"data_batch_{i + 1}"] = py2_dumps(_py10_batch(
            f"training batch {i + 1} of {len(train)}", images, labels, label_names, start))
        start += len(labels)
    files["test_batch"] = py2_dumps(_py10_batch("testing batch 1 of 1", *test, label_names, 0))
    files["batches.meta"] = py2_dumps({b"num_cases_per_batch": len(train[0][1]),
                                       b"label_names": [n.encode() for n in label_names],
                                       b"num_vis": IMAGE_BYTES})
    files["readme.html"] = _README
    return _write_layout(out, LAYOUTS["cifar10-python"], files, tar)


def _py10_batch(batch_label, images, labels, names, start) -> dict:
    # Key order as in the official files: batch_label, labels, data, filenames.
    return {b"batch_label": batch_label.encode(), b"labels": [int(c) for c in labels],
            b"data": np.asarray(images).reshape(len(images), IMAGE_BYTES),
            b"filenames": _filenames(labels, names, start)}


def write_binary10(out: str, train, test, label_names, tar: bool = False) -> str:
    """Write ``out/cifar-10-batches-bin/`` (records of 1 label byte + 3072 image bytes)."""
    def records(images, labels):
        flat = np.asarray(images, np.uint8).reshape(len(images), IMAGE_BYTES)
        return np.concatenate([np.asarray(labels, np.uint8)[:, None], flat], axis=1).tobytes()
    files = {f"data_batch_{i + 1}.bin": records(*batch) for i, batch in enumerate(train)}
    files["test_batch.bin"] = records(*test)
    files["batches.meta.txt"] = ("\n".join(label_names) + "\n\n").encode()
    files["readme.html"] = _README
    return _write_layout(out, LAYOUTS["cifar10-binary"], files, tar)


def write_python100(out: str, train, test, fine_names, coarse_names, tar: bool = False) -> str:
    """Write ``out/cifar-100-python/`` from ``(images, fine, coarse)`` for train and test."""
    def batch(label, images, fine, coarse):  # key order as in the official files
        return py2_dumps({b"filenames": _filenames(fine, fine_names, 0), b"batch_label": label,
                          b"fine_labels": [int(c) for c in fine],
                          b"coarse_labels": [int(c) for c in coarse],
                          b"data": np.asarray(images).reshape(len(images), IMAGE_BYTES)})
    files = {"train": batch(b"training batch 1 of 1", *train),
             "test": batch(b"testing batch 1 of 1", *test),
             "meta": py2_dumps({b"fine_label_names": [n.encode() for n in fine_names],
                                b"coarse_label_names": [n.encode() for n in coarse_names]}),
             "file.txt~": b""}
    return _write_layout(out, LAYOUTS["cifar100-python"], files, tar)


def _write_layout(out: str, lay: Layout, files: dict[str, bytes], tar: bool) -> str:
    """Write the files of ``lay`` under ``out``; never over an existing file (a real CIFAR
    copy or the cached official archive could sit there): DataError naming it instead."""
    directory = os.path.join(out, lay.top)
    targets = [os.path.join(directory, name) for name in files]
    targets += [os.path.join(out, lay.archive)] if tar else []
    present = next((t for t in targets if os.path.lexists(t)), None)
    if present is not None:
        raise DataError(f"{present}: already exists; writing a dataset never replaces files "
                        "(pick another --out)")
    try:
        os.makedirs(directory, exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(directory, name), "wb") as f:
                f.write(data)
        if tar:
            write_tar(os.path.join(out, lay.archive), lay.top,
                      [(name, files[name]) for name in _TAR_ORDER[lay.key]])
    except OSError as exc:
        raise DataError(f"{out}: cannot write the dataset ({one_line(exc)})") from None
    return directory


def write_tar(path: str, top: str, members: list[tuple[str, bytes]]) -> None:
    """A reproducible ``.tar.gz`` of ``top/`` and its ``(name, bytes)`` members, in that order."""
    def info(name, size, is_dir=False):
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode = size, 0, 0o755 if is_dir else 0o644
        ti.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
        return ti
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="",
                                        compresslevel=6) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tf:
        tf.addfile(info(top, 0, is_dir=True))
        for name, data in members:
            tf.addfile(info(f"{top}/{name}", len(data)), io.BytesIO(data))


# --------------------------------------------------------------------------------------------
# Python 2 pickles, as the official files were written


class _Global:
    """A module attribute written by name (``GLOBAL`` opcode)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


def py2_dumps(obj) -> bytes:
    """Pickle ``obj`` as Python 2's cPickle (protocol 2) wrote the official CIFAR files.

    Handles dict, list, tuple, int, bytes, str (written as a Python 2 str), bool, None and
    NumPy arrays of simple dtypes (reduced through ``numpy.core.multiarray._reconstruct``, the
    global the official files name). Readable by ``pickle.load(f, encoding="bytes")``.

    >>> pickle.loads(py2_dumps({b"labels": [3, 300, 70000]}), encoding="bytes")
    {b'labels': [3, 300, 70000]}
    """
    writer = _Py2Writer()
    writer.save(obj)
    return b"\x80\x02" + b"".join(writer.out) + b"."


class _Py2Writer:
    """Emits protocol-2 opcodes the way cPickle did: Python 2 str as BINSTRING, memo ids from 1."""

    def __init__(self):
        self.out: list[bytes] = []
        self.memo = 0

    def put(self):
        self.memo += 1
        self.out.append(b"q" + bytes([self.memo]) if self.memo < 256
                        else b"r" + struct.pack("<I", self.memo))

    def save(self, obj, memo: bool = True):
        if obj is None:
            self.out.append(b"N")
        elif isinstance(obj, (bool, np.bool_)):
            self.out.append(b"\x88" if obj else b"\x89")
        elif isinstance(obj, (int, np.integer)):
            self._int(int(obj))
        elif isinstance(obj, (bytes, str)):
            self._string(obj.encode("ascii") if isinstance(obj, str) else obj, memo)
        elif isinstance(obj, _Global):
            self.out.append(f"c{obj.module}\n{obj.name}\n".encode())
            self.put()
        elif isinstance(obj, np.ndarray):
            self._array(obj)
        elif isinstance(obj, np.dtype):
            self._reduce(_Global("numpy", "dtype"), (obj.str[1:], 0, 1),
                         (3, obj.str[0], None, None, None, -1, -1, 0))
        elif isinstance(obj, tuple):
            self._tuple(obj)
        elif isinstance(obj, list):
            self._items(b"]", obj, b"a", b"e")
        elif isinstance(obj, dict):
            self._items(b"}", list(obj.items()), b"s", b"u")
        else:
            raise TypeError(f"py2_dumps cannot write {type(obj).__name__}")

    def _int(self, v: int):
        if 0 <= v < 256:
            self.out.append(b"K" + bytes([v]))
        elif 0 <= v < 65536:
            self.out.append(b"M" + struct.pack("<H", v))
        elif -2 ** 31 <= v < 2 ** 31:
            self.out.append(b"J" + struct.pack("<i", v))
        else:
            data = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.out.append(b"\x8a" + bytes([len(data)]) + data)

    def _string(self, data: bytes, memo: bool):
        self.out.append((b"U" + bytes([len(data)]) if len(data) < 256
                         else b"T" + struct.pack("<i", len(data))) + data)
        if memo:
            self.put()

    def _tuple(self, items: tuple):
        if not items:
            self.out.append(b")")
            return
        if len(items) > 3:
            self.out.append(b"(")
        for item in items:
            self.save(item, memo=False)  # members of temporaries: cPickle skipped refcount-1 objects
        self.out.append({1: b"\x85", 2: b"\x86", 3: b"\x87"}.get(len(items), b"t"))

    def _items(self, empty: bytes, items: list, one: bytes, many: bytes):
        self.out.append(empty)
        self.put()
        for start in range(0, len(items), 1000):  # cPickle batched APPENDS/SETITEMS by 1000
            batch = items[start:start + 1000]
            if len(batch) > 1:
                self.out.append(b"(")
            for item in batch:
                for part in (item if empty == b"}" else (item,)):
                    self.save(part)
            self.out.append(one if len(batch) == 1 else many)

    def _reduce(self, func: _Global, args: tuple, state):
        self.save(func)
        self.save(args, memo=False)
        self.out.append(b"R")
        self.put()
        self.save(state, memo=False)
        self.out.append(b"b")

    def _array(self, arr: np.ndarray):
        if arr.dtype.kind not in "biuf" or arr.dtype.fields:
            raise TypeError(f"py2_dumps cannot write arrays of dtype {arr.dtype}")
        arr = np.ascontiguousarray(arr)
        self._reduce(_Global("numpy.core.multiarray", "_reconstruct"),
                     (_Global("numpy", "ndarray"), (0,), b"b"),
                     (1, tuple(arr.shape), arr.dtype, False, arr.tobytes()))
