"""Our own ``.npz`` reader: named numeric arrays and nothing else, sized by the file before allocation.

Weights (``model.npz``), checkpoints (``state.npz``) and anything else we load with ``np.savez``
structure go through :func:`read`, never ``np.load(allow_pickle=True)`` (which Chainer's
``serializers.load_npz`` uses): a pickle, an object array or a structured dtype is refused before
any of it is interpreted, so no file can run code.

Sizes are checked before anything is allocated: every member's ``.npy`` header must declare
exactly the bytes the zip directory says the member holds, a member may expand at most as far as
deflate can (:data:`MAX_DEFLATE_RATIO`), and with ``expected`` (the arrays a model holds) every
name, shape and dtype must match before a byte of data is read. The data are read into a fresh
buffer of the declared size and the zip CRC is checked at the end of each member.
"""
from __future__ import annotations

import ast
import io
import math
import os
import zipfile
import zlib
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from pipeline.core.errors import DataError, one_line
from pipeline.core.files import open_regular, size_of

MAX_DEFLATE_RATIO = 1032  # deflate's best case: 258 bytes from a 2-bit code, about 1032:1
MAX_HEADER = 10_000  # bytes of a .npy header dict; NumPy's own default limit
MAX_MEMBERS = 100_000  # arrays in one archive; a K=64 ipm checkpoint of resnet20 holds ~25,000
MAX_NDIM = 32
_KINDS = "biuf"  # bool, signed, unsigned, floating: what a model or optimizer state holds
_NPY_MAGIC = b"\x93NUMPY"


class Spec(NamedTuple):
    """What an entry must be: ``shape`` (None: any) and ``dtype`` (None: any numeric)."""
    shape: tuple | None
    dtype: np.dtype | None


class Mismatch(DataError):
    """A well-formed archive whose entries are not the ones expected; ``reason`` says which."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def specs_of(arrays: Mapping[str, np.ndarray]) -> dict[str, Spec]:
    """The :class:`Spec` of each array of a state dict (the template a file must match).

    >>> specs_of({"W": np.zeros((2, 3), np.float32)})
    {'W': Spec(shape=(2, 3), dtype=dtype('float32'))}
    """
    return {k: Spec(tuple(np.shape(v)), np.asarray(v).dtype) for k, v in arrays.items()}


def to_bytes(arrays: Mapping[str, np.ndarray], compress: bool = False) -> bytes:
    """``np.savez`` (or ``savez_compressed``) of ``arrays`` as bytes, for an atomic write.

    >>> sorted(read_bytes(to_bytes({"a/b": np.arange(3)}), "x"))
    ['a/b']
    """
    buf = io.BytesIO()
    (np.savez_compressed if compress else np.savez)(buf, **arrays)
    return buf.getvalue()


def read(path: str | os.PathLike, expected: Mapping[str, Spec] | None = None,
         error: type[Exception] = DataError, max_bytes: int | None = None,
         what: str = "the reader allows") -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` file ``path``: ``{name: array}``, C-contiguous, native byte order.

    ``expected``: the names, shapes and dtypes the file must hold (no more, no fewer), checked
    before any data is read; a difference raises :class:`Mismatch`. Anything else wrong (not a
    regular file, not a zip, a pickle, an object array, sizes that do not add up, a bad CRC)
    raises ``error`` with one line naming ``path``. ``max_bytes``: the most the arrays may
    add up to (``what`` says whose bound it is), checked from the sizes the archive declares
    before any member is inflated.
    """
    path = os.fspath(path)
    with open_regular(path, error) as f:
        return _read_open(f, size_of(f), path, expected, error, (max_bytes, what))


def read_bytes(data: bytes, where: str, expected: Mapping[str, Spec] | None = None,
               error: type[Exception] = DataError) -> dict[str, np.ndarray]:
    """:func:`read` of an archive already in memory; ``where`` names it in errors."""
    return _read_open(io.BytesIO(data), len(data), where, expected, error)


def _read_open(f, size: int, path: str, expected, error, bound=(None, "")
               ) -> dict[str, np.ndarray]:
    head = f.read(8)
    f.seek(0)
    _check_magic(head, path, error)
    try:
        with zipfile.ZipFile(f) as zf:
            members = _members(zf, size, path, error)
            _check_total(members, *bound, path, error)
            names = _check_names(members, expected, path)
            return {name: _read_member(zf, members[name], path, expected and expected[name], error)
                    for name in names}
    except (Mismatch, error):  # ours, before the ValueError below (DataError is one)
        raise
    except MemoryError:
        raise error(f"{path}: not enough memory to load it") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError, ValueError,
            NotImplementedError, RuntimeError) as exc:
        text = one_line(exc, kind=False, limit=160)
        raise error(f"{path}: corrupt or truncated .npz archive ({text})") from None


def _check_magic(head: bytes, path: str, error) -> None:
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return
    if not head:
        raise error(f"{path}: the file is empty, expected an .npz archive")
    if head.startswith(_NPY_MAGIC):
        raise error(f"{path}: a single .npy array, expected an .npz archive of named arrays")
    if head[:1] == b"\x80" or head[:1] in (b"(", b"c", b"}", b"]"):
        raise error(f"{path}: holds a pickle, not an .npz archive (refused: unpickling can run "
                    "code; nothing was run)")
    raise error(f"{path}: not an .npz archive (no zip signature)")


def _members(zf: zipfile.ZipFile, size: int, path: str, error) -> dict[str, zipfile.ZipInfo]:
    """{array name: ZipInfo}, after the checks that need no data: names, flags, sizes."""
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise error(f"{path}: {len(infos)} members, more than an .npz of ours holds "
                    f"({MAX_MEMBERS})")
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename
        if not name.endswith(".npy") or name.endswith("/"):
            raise error(f"{path}: member {name[:80]!r} is not an .npy array")
        key = name[:-4]
        if key in members:
            raise error(f"{path}: holds two members named {name[:80]!r}")
        if info.flag_bits & 0x1:
            raise error(f"{path}: member {name[:80]!r} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise error(f"{path}: member {name[:80]!r} uses zip compression method "
                        f"{info.compress_type} (np.savez writes only stored or deflated)")
        ratio = 1 if info.compress_type == zipfile.ZIP_STORED else MAX_DEFLATE_RATIO
        if info.compress_size > size or info.file_size > max(info.compress_size, 64) * ratio:
            raise error(f"{path}: member {name[:80]!r} declares {info.file_size} bytes from "
                        f"{info.compress_size} stored in a {size}-byte file (impossible)")
        members[key] = info
    if sum(info.compress_size for info in infos) > size:  # members sharing bytes: a zip bomb
        raise error(f"{path}: members overlap (their sizes add up to more than the file)")
    if not members:
        raise error(f"{path}: holds no arrays")
    return members


HEADER_SLACK = 1024  # bytes of .npy header per member on top of its array (NumPy writes 128)


def _check_total(members: Mapping, max_bytes: int | None, what: str, path: str, error) -> None:
    """``error`` when the members' declared sizes exceed ``max_bytes`` (plus their headers)."""
    if max_bytes is None:
        return
    declared = sum(info.file_size for info in members.values())
    if declared > max_bytes + HEADER_SLACK * len(members):
        raise error(f"{path}: its arrays declare {declared} bytes, more than {what} "
                    f"(at most {max_bytes} bytes; refused before inflating any)")


def _check_names(members: Mapping, expected: Mapping | None, path: str) -> list[str]:
    if expected is None:
        return list(members)
    missing = [k for k in expected if k not in members]
    if missing:
        raise Mismatch(path, f"no entry {missing[0]!r}"
                       + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""))
    extra = [k for k in members if k not in expected]
    if extra:
        raise Mismatch(path, f"unexpected entry {extra[0][:80]!r}"
                       + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return list(expected)


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: str, spec: Spec | None,
                 error) -> np.ndarray:
    where = f"{path}:{info.filename[:80]}"
    with zf.open(info) as member:
        dtype, shape, fortran, header_bytes = _header(member, where, error)
        nbytes = math.prod(shape) * dtype.itemsize
        if header_bytes + nbytes != info.file_size:
            raise error(f"{where}: the header declares shape {shape} of {dtype} ({nbytes} bytes) "
                        f"but the member holds {info.file_size - header_bytes} bytes")
        if spec is not None:
            _check_spec(spec, shape, dtype, info.filename[:-4], path)
        buf = bytearray(nbytes)
        view, got = memoryview(buf), 0
        while got < nbytes:
            n = member.readinto(view[got:])
            if not n:
                raise error(f"{where}: truncated ({got} of {nbytes} data bytes)")
            got += n
        if member.read(1):  # also makes zipfile check the CRC at the end of the member
            raise error(f"{where}: more data than its header declares")
    array = np.frombuffer(buf, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    if fortran or not dtype.isnative:  # (not ascontiguousarray: it makes 0-d arrays 1-d)
        array = np.array(array, dtype=dtype.newbyteorder("="), order="C")
    return array


def _header(member, where: str, error) -> tuple[np.dtype, tuple, bool, int]:
    """(dtype, shape, fortran order, header length) of a .npy stream, checked before use."""
    magic = member.read(8)
    if len(magic) < 8 or not magic.startswith(_NPY_MAGIC):
        raise error(f"{where}: not an .npy array (bad magic)")
    major = magic[6]
    if major not in (1, 2, 3):
        raise error(f"{where}: unsupported .npy format version {major}.{magic[7]}")
    width = 2 if major == 1 else 4
    length = int.from_bytes(member.read(width), "little")
    if length > MAX_HEADER:
        raise error(f"{where}: .npy header of {length} bytes (at most {MAX_HEADER})")
    raw = member.read(length)
    if len(raw) != length:
        raise error(f"{where}: truncated .npy header")
    try:
        text = raw.decode("utf-8" if major == 3 else "latin-1")
        header = ast.literal_eval(text.strip())
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError, UnicodeDecodeError):
        raise error(f"{where}: unreadable .npy header") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise error(f"{where}: .npy header is not a dict of descr, fortran_order and shape")
    return (_dtype(header["descr"], where, error), _shape(header["shape"], where, error),
            _flag(header["fortran_order"], where, error), 8 + width + length)


def _dtype(descr, where: str, error) -> np.dtype:
    if not isinstance(descr, str) or len(descr) > 8:
        raise error(f"{where}: refused dtype {str(descr)[:40]!r} (only plain numbers: bool, "
                    "int, uint, float; no objects, records or strings)")
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError):
        raise error(f"{where}: unknown dtype {descr!r}") from None
    if dtype.kind not in _KINDS or dtype.hasobject or dtype.fields or dtype.subdtype \
            or dtype.itemsize > 16:
        raise error(f"{where}: refused dtype {descr!r} (only plain numbers: bool, int, uint, "
                    "float; no objects, records or strings)")
    return dtype


def _shape(shape, where: str, error) -> tuple:
    if not isinstance(shape, tuple) or len(shape) > MAX_NDIM or \
            not all(type(n) is int and n >= 0 for n in shape):
        raise error(f"{where}: bad .npy shape {str(shape)[:60]}")
    return shape


def _flag(value, where: str, error) -> bool:
    if type(value) is not bool:
        raise error(f"{where}: bad .npy fortran_order {str(value)[:20]}")
    return value


def _check_spec(spec: Spec, shape: tuple, dtype: np.dtype, name: str, path: str) -> None:
    if spec.shape is not None and tuple(spec.shape) != shape:
        raise Mismatch(path, f"{name!r} has shape {shape}, expected {tuple(spec.shape)}")
    if spec.dtype is not None and np.dtype(spec.dtype) != dtype.newbyteorder("="):
        raise Mismatch(path, f"{name!r} has dtype {dtype}, expected {np.dtype(spec.dtype)}")
