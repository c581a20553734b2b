"""Python 2 pickles (protocol 2), byte for byte as cPickle wrote the official CIFAR files."""
from __future__ import annotations

import struct

import numpy as np


class _Global:
    """A module attribute written by name (``GLOBAL`` opcode)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


def py2_dumps(obj) -> bytes:
    """Pickle ``obj`` as Python 2's cPickle (protocol 2) wrote the official CIFAR files.

    Handles dict, list, tuple, int, bytes, str (written as a Python 2 str), bool, None and
    NumPy arrays of simple dtypes (reduced through ``numpy.core.multiarray._reconstruct``, the
    global the official files name). Readable by ``pickle.load(f, encoding="bytes")``.

    >>> import pickle
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
            # members of temporaries: cPickle skipped refcount-1 objects
            self.save(item, memo=False)
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
