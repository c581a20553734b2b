"""Data already in memory or on the cluster as a reader: Dask arrays, NumPy arrays and Chainer
datasets passed as ``train(config, data=...)``, checked and normalised to the Dataset every
other reader gives (``(N, 3, H, W) uint8`` images, ``(N,) int32`` labels).

A Dask array's chunks become the dataset's blocks as they are: nothing is gathered to the
driver but the labels and one 8-byte hash per image (the fingerprint), computed where the
blocks are (on ``client``, or the default scheduler, which is a distributed Client's when one
exists). ``(N, H, W, C)`` is transposed and float images scaled block by block, lazily, in the
same graph. Training reads them by global row (``pipeline.data.augment``), so any chunking of
the same arrays gives the same bytes.

Accepted ``data``: an :class:`ArrayData`, a dict of its fields, ``(x_train, y_train[, x_test,
y_test])`` or ``(train, test)`` Chainer datasets (``TupleDataset``, ``LabeledImageDataset``,
``get_cifar10()``'s pair). Without a test split, ``data.val_fraction`` of each class is held out
by the seeded split of image folders (``data.split_seed``).
"""
from __future__ import annotations

import hashlib
import os
from typing import NamedTuple

import dask
import dask.array as da
import numpy as np

from pipeline.core import keys
from pipeline.core.errors import DataError, one_line
from pipeline.data import array_checks as checks
from pipeline.data.array_checks import fmt_bytes
from pipeline.data.readers import Plan, Reader

PREFIX = "arrays:"  # data.source of a run given data= : "arrays:<16-hex fingerprint>"
LAYOUT = "(N, 3, H, W) or (N, H, W, 3) images (1 channel is repeated to 3)"
BLOCK_BYTES = 64 << 20  # NumPy / Chainer data: rows per block so one block is about 64 MiB
PIECE_BYTES = 8 << 20  # float images are scaled this many bytes of float64 at a time
GRAPH_LIMIT = "distributed.admin.large-graph-warning-threshold"


class ArrayData(NamedTuple):
    """What ``train(config, data=...)`` takes (a tuple or dict of these fields works too)."""
    x_train: object  # (N, 3, H, W) or (N, H, W, 3): dask / NumPy array, uint8 or float in
    #                  [0, 1] / [0, 255]; or a Chainer dataset of (image, label) pairs
    y_train: object = None  # (N,) integer labels (None with a Chainer dataset)
    x_test: object = None  # the test split, like x_train; None: held out of the training data
    y_test: object = None
    n_classes: int | None = None  # None: the largest label + 1, and every class must be present
    label_names: tuple | None = None  # class index -> name (default "0", "1", ...)


class Block(NamedTuple):
    """One chunk of a split as a Plan lists it (only its size: the data is already an array)."""
    n: int


# --------------------------------------------------------------------------------------------
# Reader


def claims(source, cfg) -> bool:
    """Anything that is not a path, and the ``arrays:`` source a data= run records."""
    return not isinstance(source, (str, os.PathLike)) or str(source).startswith(PREFIX)


def plan(source, cfg, download: bool = False, client=None) -> Plan:
    """Check and normalise ``source`` (see the module docstring) -> Plan with ``arrays`` set."""
    if isinstance(source, (str, os.PathLike)):
        raise DataError(f"this run trained on arrays given from Python ({str(source)[:40]}), "
                        "which no path finds again: resume it in Python with train(config, "
                        "data=<the same arrays>, resume=True) (their fingerprint is checked); "
                        "evaluate --run and predict --run need only the run directory")
    parts = as_parts(source)
    x, kind, y = images(parts.x_train, "x_train")
    xt, _, yt = images(parts.x_test, "x_test") if parts.x_test is not None else (None, kind, None)
    with carried(x, xt):
        return _checked(parts, x, kind, y, xt, yt, cfg, client)


def _checked(parts, x, kind, y, xt, yt, cfg, client) -> Plan:
    y = parts.y_train if parts.y_train is not None else y
    yt = parts.y_test if parts.y_test is not None else yt
    x, xt = _scaled(x, xt, client)
    wanted = [_labels(y, x, "y_train")] + ([_labels(yt, xt, "y_test")] if xt is not None else [])
    y, yt = (_compute(wanted, client) + [None])[:2]
    checks.labels_arrived(y, x.shape[0], "y_train")
    checks.labels_arrived(yt, xt.shape[0] if xt is not None else 0, "y_test")
    n_classes = checks.check_labels(y, yt, parts.n_classes)
    y, yt = y.astype(np.int64), (yt.astype(np.int64) if yt is not None else None)
    if xt is None:
        x, y, xt, yt = checks.held_out(x, y, cfg)
    checks.check_shape(x, xt, cfg)
    names = checks.names(parts.label_names, n_classes)
    digest = fingerprint(x, y, xt, yt, n_classes, client)
    counts = np.bincount(y, minlength=n_classes)
    info = {"kind": kind, "fingerprint": digest, "chunks": [len(x.chunks[0]), len(xt.chunks[0])],
            "class_counts": {"train": dict(zip(names, counts.tolist())),
                             "val": dict(zip(names, np.bincount(yt, minlength=n_classes)
                                             .tolist()))},
            "bytes": {"train": checks.nbytes(x), "test": checks.nbytes(xt)}}
    label = lambda v, a: da.from_array(v.astype(np.int32), chunks=(a.chunks[0],))  # noqa: E731
    return Plan(tuple(Block(n) for n in x.chunks[0]), tuple(Block(n) for n in xt.chunks[0]),
                names, tuple(int(c) for c in counts), ("arrays", digest), PREFIX + digest,
                read=None, image_shape=tuple(x.shape[1:]), info=info,
                arrays=(x, label(y, x), xt, label(yt, xt)))


ARRAYS = Reader("arrays", claims, plan, checks_on_driver=True, refindable=False)


def carried(*arrays):
    """dask config raising distributed's large-graph warning limit by ``arrays``' bytes.

    Data given as NumPy arrays or Chainer datasets travels inside the graph on purpose: the
    scheduler keeps each block's task, so a block on a lost worker is rebuilt from it as a file
    block is read again. Distributed's warning would advise loading "with Dask directly", which
    asks the user for something other than what they gave.
    """
    import distributed  # noqa: F401  (its defaults first: a key set before them would drop them)
    from dask.utils import parse_bytes
    limit = parse_bytes(dask.config.get(GRAPH_LIMIT))
    return dask.config.set({GRAPH_LIMIT: limit + sum(int(a.nbytes) for a in arrays
                                                     if a is not None)})


def client_of(data):
    """The distributed Client that holds ``data``'s persisted Dask arrays, or None."""
    from distributed import futures_of
    for part in as_parts(data)[:4] if data is not None else ():
        if isinstance(part, da.Array):
            futures = futures_of(part)
            if futures:
                return futures[0].client
    return None


# --------------------------------------------------------------------------------------------
# Stores: one read- task per block of rows, opened on the worker that runs it


def read_rows(path: str, dataset: str | None, lo: int, hi: int) -> np.ndarray:
    """The ``read-`` task: rows ``lo:hi`` of an ``.npy`` file (memory-mapped) or of the HDF5
    dataset ``dataset`` (h5py, imported only here), as an in-memory array."""
    if dataset is None:
        return np.array(np.load(path, mmap_mode="r")[lo:hi])
    import h5py
    with h5py.File(path, "r") as f:
        return f[dataset][lo:hi]


def from_store(path: str, dataset: str | None = None, rows: int = 4096) -> da.Array:
    """A Dask array of an ``.npy`` file (``dataset`` None) or an HDF5 dataset whose blocks of
    ``rows`` rows are read on the workers (``("read-<token>", i, 0, ...)``): the file is opened
    in each task, so nothing but its path travels (a memmap or an h5py object in a graph would
    be pickled whole, or not at all). Zarr needs none of this: ``da.from_zarr(path)``.

    >>> import tempfile; p = tempfile.mkdtemp() + "/x.npy"; np.save(p, np.arange(10))
    >>> from_store(p, rows=4).chunks, int(from_store(p, rows=4).sum().compute())
    (((4, 4, 2),), 45)
    """
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
    from dask.task_spec import Task
    if dataset is None:
        header = np.load(path, mmap_mode="r")
        shape, dtype = header.shape, header.dtype
    else:
        import h5py
        with h5py.File(path, "r") as f:
            shape, dtype = f[dataset].shape, f[dataset].dtype
    st = os.stat(path)
    name = keys.prefix("read", tokenize(os.path.abspath(path), dataset, st.st_size,
                                        st.st_mtime_ns, rows)[:8])
    bounds = list(range(0, shape[0], rows)) + [shape[0]]
    tail = (0,) * (len(shape) - 1)
    layer = {(name, i, *tail): Task((name, i, *tail), read_rows, path, dataset, lo, hi)
             for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))}
    chunks = (tuple(np.diff(bounds).tolist()),) + tuple((d,) for d in shape[1:])
    return da.Array(HighLevelGraph.from_collections(name, layer, dependencies=()), name, chunks,
                    dtype=dtype)


# --------------------------------------------------------------------------------------------
# Normalising


def as_parts(data) -> ArrayData:
    """``data`` as an :class:`ArrayData` (fields not checked yet)."""
    if isinstance(data, ArrayData):
        return data
    if isinstance(data, dict):
        unknown = set(data) - set(ArrayData._fields)
        if unknown:
            raise DataError(f"data: unknown key {sorted(unknown)[0]!r} (expected "
                            f"{', '.join(ArrayData._fields)})")
        return ArrayData(**data)
    if isinstance(data, (tuple, list)):
        if len(data) == 2 and _is_dataset(data[0]):  # (train, test) Chainer datasets
            return ArrayData(data[0], None, data[1], None)
        if len(data) in (2, 4):
            return ArrayData(*data)
        raise DataError(f"data: expected (x_train, y_train[, x_test, y_test]) or (train, test) "
                        f"datasets, got a {type(data).__name__} of {len(data)}")
    if _is_dataset(data):
        return ArrayData(data)
    raise DataError(f"data: expected Dask or NumPy arrays (x_train, y_train[, x_test, y_test]), "
                    f"Chainer datasets or a path, got {type(data).__name__}")


def _is_dataset(obj) -> bool:
    """A Chainer-style dataset: indexable, sized, and not an array."""
    return (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")
            and not hasattr(obj, "shape") and not isinstance(obj, (str, bytes, dict)))


def _from_dataset(ds, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A Chainer dataset of ``(image, label)`` -> ``(images, labels)`` NumPy arrays."""
    inner = getattr(ds, "_datasets", None)  # TupleDataset: its arrays as they are
    if inner is not None and len(inner) == 2:
        return np.asarray(inner[0]), np.asarray(inner[1])
    if len(ds) == 0:
        raise DataError(f"{name}: the dataset is empty")
    first = ds[0]
    if not (isinstance(first, tuple) and len(first) == 2):
        raise DataError(f"{name}: a dataset of (image, label) pairs expected, its first example "
                        f"is a {type(first).__name__}")
    shape, n = np.shape(first[0]), len(ds)
    checks.check_length(n, first[0], name, _available_memory())
    out = np.empty((n,) + shape, np.asarray(first[0]).dtype)
    labels = np.empty(n, np.asarray(first[1]).dtype)
    for i in range(n):
        try:
            image, labels[i] = ds[i]
        except IndexError as exc:  # a len() larger than what the dataset holds
            raise DataError(f"{name}: example {i} cannot be read ({one_line(exc)}), though the "
                            f"dataset's len is {n}") from None
        if np.shape(image) != shape:
            raise DataError(f"{name}: example {i} is {np.shape(image)}, example 0 {shape}: all "
                            f"images must have one size (resize them, or give a file list)")
        out[i] = image
    return out, labels


def _available_memory() -> int:
    import psutil  # distributed's dependency
    return int(psutil.virtual_memory().available)


def images(x, name: str) -> tuple[da.Array, str, np.ndarray | None]:
    """``x`` -> ``((N, 3, H, W) dask array chunked along N only, kind, a Chainer dataset's
    labels or None)``; 1 channel repeated. Dtype and scale are fixed later (:func:`_scaled`)."""
    kind, labels = "dask arrays", None
    if _is_dataset(x):
        x, labels = _from_dataset(x, name)
        kind = "chainer datasets"
    if isinstance(x, np.ndarray) or (not isinstance(x, da.Array) and hasattr(x, "__array__")):
        x = np.asarray(x)
        kind = "numpy arrays" if kind == "dask arrays" else kind
        if x.ndim != 4 or len(x) == 0:
            raise DataError(f"{name}: shape {x.shape} is not {LAYOUT}" if x.ndim != 4 else
                            f"data: {name} holds no image")
        rows = max(1, BLOCK_BYTES // max(1, x[0].nbytes))
        x = da.from_array(x, chunks=(rows, -1, -1, -1))
    elif isinstance(x, da.Array):  # the blocks checked against what the array declares
        x = _declared(x, name)
    if not isinstance(x, da.Array):
        raise DataError(f"{name}: expected a Dask or NumPy array, got {type(x).__name__}")
    if x.shape[1] not in (1, 3) and x.shape[3] in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    if x.shape[1] not in (1, 3):
        raise DataError(f"{name}: shape {x.shape} has no 3-channel axis; expected {LAYOUT}")
    if x.shape[1] == 1:
        x = da.repeat(x, 3, axis=1)
    if x.dtype == bool or x.dtype.kind not in "uif":
        raise DataError(f"{name}: dtype {x.dtype} is not uint8 or float images")
    return x.rechunk({1: -1, 2: -1, 3: -1}), kind, labels


def _declared(x: da.Array, name: str) -> da.Array:
    """``x`` whose every block is checked, in the task that reads it, against the shape and dtype
    ``x`` declares (``array_checks.check_block``); DataError for an array that says so itself."""
    if x.ndim != 4:
        raise DataError(f"{name}: shape {x.shape} is not {LAYOUT}")
    if any(np.isnan(c) for axis in x.chunks for c in axis):
        raise DataError(f"{name}: unknown chunk sizes; call {name}.compute_chunk_sizes() first")
    if x.shape[0] == 0:
        raise DataError(f"data: {name} holds no image")
    return da.map_blocks(checks.check_block, x, name, dtype=x.dtype, meta=x._meta)


def _scaled(x: da.Array, xt, client) -> tuple[da.Array, object]:
    """uint8 images as they are; other dtypes checked (one pass) and mapped to uint8: floats
    in [0, 1] (``chainer.datasets.get_cifar10``) times 255, in [0, 255] and integers in
    [0, 255] rounded; anything else refused."""
    todo = [a for a in (x, xt) if a is not None and a.dtype != np.uint8]
    if not todo:
        return x, xt
    bounds = _compute([v for a in todo for v in (a.min(), a.max())], client)
    for i, a in enumerate(todo):
        lo, hi = float(bounds[2 * i]), float(bounds[2 * i + 1])
        if not (np.isfinite(lo) and np.isfinite(hi)) or lo < 0 or hi > 255:
            raise DataError(f"{'x_train' if a is x else 'x_test'}: {a.dtype} values in "
                            f"[{lo:g}, {hi:g}]; expected uint8, or floats in [0, 1] or [0, 255]")
    floats = [float(bounds[2 * i + 1]) for i, a in enumerate(todo) if a.dtype.kind == "f"]
    scale = 255.0 if floats and max(floats) <= 1 else 1.0  # one scale for both splits
    convert = lambda a: a if a is None or a.dtype == np.uint8 else da.map_blocks(  # noqa: E731
        to_uint8, a, scale if a.dtype.kind == "f" else 1.0, dtype=np.uint8)
    return convert(x), convert(xt)


def to_uint8(block: np.ndarray, scale: float) -> np.ndarray:
    """``block * scale`` rounded to uint8 (the per-block kernel of float images), in pieces of
    ``PIECE_BYTES`` of float64: memory past the output stays ~16 MiB whatever the block's size.

    >>> to_uint8(np.array([0.0, 0.5, 1.0], np.float32), 255.0).tolist()
    [0, 128, 255]
    """
    out = np.empty(np.shape(block), np.uint8)
    if out.ndim == 0 or len(out) == 0:
        return np.clip(np.rint(np.asarray(block, np.float64) * scale), 0, 255).astype(np.uint8)
    rows = max(1, PIECE_BYTES // max(1, out[0].size * 8))  # a 1 GB chunk is not copied whole
    for lo in range(0, len(out), rows):
        piece = block[lo:lo + rows].astype(np.float64)
        np.multiply(piece, scale, out=piece)
        np.clip(np.rint(piece, out=piece), 0, 255, out=piece)
        out[lo:lo + rows] = piece
    return out


def _labels(y, x: da.Array, name: str):
    """``y`` as something to compute: a 1-D integer array of ``len(x)`` labels."""
    if y is None:
        raise DataError(f"{name}: labels missing")
    shape, dtype = np.shape(y) if not isinstance(y, da.Array) else y.shape, \
        getattr(y, "dtype", np.asarray(y).dtype)
    if len(shape) != 1 or shape[0] != x.shape[0]:
        raise DataError(f"{name}: shape {tuple(shape)}, expected ({x.shape[0]},): one integer "
                        "label per image")
    if np.dtype(dtype).kind not in "iu":
        raise DataError(f"{name}: dtype {dtype}, expected integer labels")
    return y


def _compute(values: list, client) -> list:
    if client is not None:
        return [np.asarray(v) for v in client.gather(client.compute(values))]
    return [np.asarray(v) for v in dask.compute(*values)]


# --------------------------------------------------------------------------------------------
# Fingerprint


def row_hashes(block: np.ndarray) -> np.ndarray:
    """(n, ...) -> (n,) uint64: an 8-byte BLAKE2b of each row (the per-block kernel)."""
    return np.array([int.from_bytes(hashlib.blake2b(np.ascontiguousarray(r).tobytes(),
                                                    digest_size=8).digest(), "little")
                     for r in block], np.uint64)


def fingerprint(x: da.Array, y: np.ndarray, xt: da.Array, yt: np.ndarray, n_classes: int,
                client=None) -> str:
    """16 hex digits of the images (a hash per image, computed where the blocks are), labels,
    shapes and class count: the same for any chunking of the same data."""
    hashes = [a.map_blocks(row_hashes, drop_axis=[1, 2, 3], dtype=np.uint64) for a in (x, xt)]
    h, ht = _compute(hashes, client)
    digest = hashlib.sha1(repr((x.shape, xt.shape, n_classes)).encode())
    for part in (h, y.astype(np.int64), ht, yt.astype(np.int64)):
        digest.update(np.ascontiguousarray(part).tobytes())
    return digest.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Report


def summary_lines(info: dict, n_train: int, n_test: int, shape: tuple) -> list[str]:
    """What a data= run logs before training: the inspect summary and the workers' memory.

    >>> info = {"kind": "numpy arrays", "fingerprint": "ab", "chunks": [1, 1],
    ...         "class_counts": {"train": {"0": 6, "1": 4}}, "bytes": {"train": 30720,
    ...         "test": 6144}}
    >>> print("\\n".join(summary_lines(info, 10, 2, (3, 32, 32))))
    data: numpy arrays, 10 train / 2 test images of 3x32x32 uint8 in 1 / 1 blocks, 2 classes (4..6 train images each), fingerprint ab
    memory on the workers: training images 30.0 KiB held once across the cluster, plus up to 30.0 KiB on each worker that augments (it gathers the blocks); test images 6.0 KiB
    """
    counts = list(info["class_counts"]["train"].values())
    b = info["bytes"]
    return [f"data: {info['kind']}, {n_train} train / {n_test} test images of "
            f"{'x'.join(map(str, shape))} uint8 in {info['chunks'][0]} / {info['chunks'][1]} "
            f"blocks, {len(counts)} classes ({min(counts)}..{max(counts)} train images each), "
            f"fingerprint {info['fingerprint']}",
            f"memory on the workers: training images {fmt_bytes(b['train'])} held once across the "
            f"cluster, plus up to {fmt_bytes(b['train'])} on each worker that augments (it gathers "
            f"the blocks); test images {fmt_bytes(b['test'])}"]
