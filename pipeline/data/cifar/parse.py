"""Parsing and validating CIFAR batch and meta files: a restricted unpickler that runs nothing.

The pickles are read with a restricted unpickler that resolves only numpy's array
reconstruction globals: anything else is refused before it can run.
"""
from __future__ import annotations

import io
import math
import pickle
import pickletools

import numpy as np

from pipeline.core.errors import DataError
from pipeline.core.files import os_reason
from pipeline.data.cifar.layout import IMAGE_BYTES, IMAGE_SHAPE, RECORD_BYTES


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
                        f"{os_reason(exc)})") from None


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

    >>> from pipeline.data.cifar.py2pickle import py2_dumps
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
                        f"{os_reason(exc)})") from None


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
    """One batch file's bytes -> validated images ``(n, 3, 32, 32) uint8``, labels ``(n,) int32``.

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
