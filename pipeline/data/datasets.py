"""Datasets as Dask graphs: pick the reader of a ``--data`` source, download CIFAR on request, one read task per chunk.

Readers are peers registered in :data:`READERS` (``pipeline.data.readers``): synthetic, file lists and
image folders (``pipeline.data.images``, ``decode-`` tasks), CIFAR python / binary / CIFAR-100
(``pipeline.data.cifar``, ``load-`` tasks). The file formats are pure modules; this module only decides
where the data is and wires a reader's task body into a graph, e.g. for CIFAR::

    ("load-<token>", i)            -> (images, labels) of batch file i      one read per file
    ("images-<token>", i, 0, 0, 0) -> getitem(load i, 0)   (n_i, 3, 32, 32) uint8
    ("labels-<token>", i)          -> getitem(load i, 1)   (n_i,) int32

The token derives from what the data is (path, sizes and mtimes, or the synthetic sizes and
seed), so the same inputs give the same keys and the dashboard groups them under ``load``.
"""
from __future__ import annotations

import logging
import operator
import os
import re
import sys
from typing import NamedTuple

import dask
import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.task_spec import Task, TaskRef

from pipeline.data import arrays, cifar, rows
from pipeline.data.images import FILE_LIST, IMAGE_FOLDER
from pipeline.core import keys
from pipeline.core.config_data import DataConfig
from pipeline.core.errors import DataError, one_line
from pipeline.core.files import os_reason
from pipeline.data.readers import Plan, Reader, checked

BASE_URL = "https://www.cs.toronto.edu/~kriz/"
# (dataset, format) -> (official archive, its published MD5); both from BASE_URL + "cifar.html"
ARCHIVES = {
    ("cifar10", "python"): ("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
    ("cifar10", "binary"): ("cifar-10-binary.tar.gz", "c32a1d4ab5d03f1284b67883e8d87530"),
    ("cifar100", "python"): ("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
}
# --data names that mean "the official archive in the cache" rather than a path
DATASET_NAMES = {"cifar10": ("cifar10", "python"), "cifar10-binary": ("cifar10", "binary"),
                 "cifar100": ("cifar100", "python")}
CACHE_ENV = "DASK_CHAINER_CACHE"  # overrides the default cache directory
SYNTHETIC_SIZES = (5000, 1000)  # train, test images of --data synthetic
SYNTHETIC_SEED = 0  # data seed of the on-the-fly synthetic sources (same as `synth --seed 0`)
# The most synthetic:N:M draws: what write_synthetic can write in the official layout (5 training
# files and a test file, each at most cifar.MAX_IMAGES_PER_FILE images); 920 MB of training pixels.
MAX_SYNTHETIC = (cifar.TRAIN_BATCHES * cifar.MAX_IMAGES_PER_FILE, cifar.MAX_IMAGES_PER_FILE)


class Dataset(NamedTuple):
    """A dataset as lazy dask arrays; nothing is read until they are computed."""
    train_images: da.Array  # (N, 3, H, W) uint8 (CIFAR 32x32), one chunk per batch file / chunk
    train_labels: da.Array  # (N,) int32, same chunks
    test_images: da.Array  # (M, 3, H, W) uint8
    test_labels: da.Array  # (M,) int32
    label_names: list[str]
    n_classes: int
    source: str  # what was loaded: "synthetic:N:M" or the resolved path
    stream: object = None  # image sources: the training files for decoding them again each epoch
    #                        when they are not cached (pipeline.data.images.Stream)
    info: dict | None = None  # the reader's extra inspect fields (arrays: the fingerprint, ...)
    kind: str = "cifar10"  # what the data is (KINDS): recorded as config.json's data.dataset
    splits: tuple = ("train", "test")  # the splits' names: image sources evaluate on "val"
    notes: tuple = ()  # one-line warnings about the data (a file named for another dataset)


def load_dataset(source: str, cfg: DataConfig | None = None, download: bool = False,
                 client=None) -> Dataset:
    """A source -> :class:`Dataset` of dask arrays, one ``load-`` (CIFAR) or ``decode-`` (image
    folder, file list) task per chunk.

    ``source``: ``"synthetic"`` (5,000 train / 1,000 test made in the load- tasks, data seed 0),
    ``"synthetic:N:M"``, a CIFAR directory or official tarball, or ``cifar10`` / ``cifar10-binary``
    / ``cifar100`` for the official archive in the cache. With ``download`` (or
    ``cfg.download``) a missing official archive is fetched, MD5-checked; a present one is used.
    ``cfg`` gives the cache directory and, for CIFAR-100, the label kind; ``source`` wins over
    ``cfg.source``. Bad data raises DataError here, before any training task runs: CIFAR files
    are read on the client, image files checked by ``scan-`` tasks (on ``client`` when given, else
    on dask's default scheduler).

    Compute or persist images and labels together (as :func:`dataset_arrays` does): then each
    file is read once and the scheduler shows ``load``, ``images`` and ``labels`` tasks. Alone,
    one array still reads each file once, but dask fuses ``load`` into it (``load-images``).

    >>> ds = load_dataset("synthetic:50:10")
    >>> ds.train_images.shape, ds.train_images.chunks[0], ds.test_labels.dtype
    ((50, 3, 32, 32), (10, 10, 10, 10, 10), dtype('int32'))
    """
    cfg = cfg or DataConfig()
    plan = _plan(source, cfg, download, client)
    if plan.arrays is not None:  # data that is an array already (pipeline.data.arrays)
        train_images, train_labels, test_images, test_labels = plan.arrays
    else:
        train_images, train_labels = _arrays(plan, plan.train, "train")
        test_images, test_labels = _arrays(plan, plan.test, "test")
    kind = kind_of(source, cfg, plan)
    splits = ("train", facts(kind).eval_split)
    return Dataset(train_images, train_labels, test_images, test_labels, list(plan.label_names),
                   len(plan.label_names), plan.source, plan.stream, plan.info, kind, splits,
                   name_mismatch(source, kind))


def kind_of(source: str, cfg: DataConfig, plan: Plan) -> str:
    """Which of :data:`KINDS` a planned source is.

    >>> kind_of("synthetic:50:10", DataConfig(), _plan("synthetic:50:10", DataConfig(), False))
    'synthetic'
    """
    name = reader_for(source, cfg).name
    if name != "cifar":
        return name
    return "cifar100" if str(plan.ident[0]).startswith("cifar100") else "cifar10"


def name_mismatch(source: str, kind: str) -> tuple:
    """A one-line warning when the source's name says one CIFAR and its files hold the other
    (a CIFAR-100 archive renamed, or given where CIFAR-10 was meant).

    >>> name_mismatch("/data/cifar-10-python.tar.gz", "cifar100")[0][:60]
    'warning: /data/cifar-10-python.tar.gz holds CIFAR-100 (100 c'
    >>> name_mismatch("cifar10", "cifar10")
    ()
    """
    if kind not in ("cifar10", "cifar100"):
        return ()
    base = os.path.basename(str(source).rstrip(os.sep)).lower().replace("_", "-")
    says100 = bool(re.search(r"cifar-?100", base))
    says10 = bool(re.search(r"cifar-?10(?!0)", base))
    if kind == "cifar100" and says10 and not says100:
        return (f"warning: {source} holds CIFAR-100 (100 classes), not CIFAR-10 as its name "
                "says; training 100 classes",)
    if kind == "cifar10" and says100:
        return (f"warning: {source} holds CIFAR-10 (10 classes), not CIFAR-100 as its name "
                "says; training 10 classes",)
    return ()


def inspect_dataset(source: str, download: bool = False, cfg: DataConfig | None = None) -> dict:
    """Counts, image shape, class names and training class histogram of a source (plain ints).

    >>> info = inspect_dataset("synthetic:100:20")
    >>> info["train"], info["test"], info["classes"], info["shape"], info["class_counts_train"][:3]
    (100, 20, 10, [3, 32, 32], [10, 10, 10])
    """
    plan = _plan(source, cfg or DataConfig(), download)
    return {"train": sum(c.n for c in plan.train), "test": sum(c.n for c in plan.test),
            "classes": len(plan.label_names), "shape": list(plan.image_shape),
            "label_names": list(plan.label_names),
            "class_counts_train": [int(c) for c in plan.class_counts_train],
            **(plan.info or {})}


def dataset_arrays(dataset: Dataset) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Compute all four arrays in one pass (each batch file read once):
    ``(train_images, train_labels, test_images, test_labels)`` as NumPy arrays."""
    return dask.compute(dataset.train_images, dataset.train_labels, dataset.test_images,
                        dataset.test_labels)


# --------------------------------------------------------------------------------------------
# Sources


def parse_synthetic(source: str) -> tuple[int, int] | None:
    """``"synthetic"`` -> (5000, 1000); ``"synthetic:N:M"`` -> (N, M); anything else -> None.

    >>> parse_synthetic("synthetic:600:100"), parse_synthetic("./data")
    ((600, 100), None)
    """
    if source == "synthetic":
        return SYNTHETIC_SIZES
    if not source.startswith("synthetic:"):
        return None
    match = re.fullmatch(r"synthetic:(\d+):(\d+)", source)
    # int() refuses strings of over 4,300 digits: anything past 12 digits is "too many" anyway
    n, m = (min(int(g.lstrip("0")[:13] or 0), 10 ** 12) for g in match.groups()) if match \
        else (0, 0)
    if n < 1 or m < 1:
        raise DataError(f"data source {source[:60]!r} must be synthetic or synthetic:N:M with "
                        "N, M >= 1 (train and test images)")
    if n > MAX_SYNTHETIC[0] or m > MAX_SYNTHETIC[1]:
        raise DataError(f"data source {source[:60]!r} asks for more images than a CIFAR set of files "
                        f"holds (at most synthetic:{MAX_SYNTHETIC[0]}:{MAX_SYNTHETIC[1]}: five "
                        f"training files and one test file of {cifar.MAX_IMAGES_PER_FILE})")
    return n, m


def reader_for(source: str, cfg: DataConfig) -> Reader:
    """The first registered reader that claims ``source`` (CIFAR claims whatever is left).

    >>> reader_for("synthetic:50:10", DataConfig()).name
    'synthetic'
    """
    source = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source
    return next(r for r in READERS if r.claims(source, cfg))


def checks_on_driver(source: str, cfg: DataConfig) -> bool:
    """Whether ``source``'s reader checks its files on the driver (synthetic, CIFAR: load the
    data before a cluster starts) rather than in scan- tasks on the workers (image folders,
    file lists: load it once a client exists).

    >>> checks_on_driver("synthetic", DataConfig())
    True
    """
    return reader_for(source, cfg).checks_on_driver


def _plan(source: str, cfg: DataConfig, download: bool, client=None) -> Plan:
    cfg.validate()
    facts(cfg.dataset)  # a kind some reader records
    source = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source
    reader = reader_for(source, cfg)
    side = reader.image_side
    if side is not None and cfg.image_size not in (None, side):
        raise DataError(f"data.image_size {cfg.image_size} applies to image folders and file "
                        f"lists; {reader.name} images are {side}x{side}")
    return checked(reader.plan(source, cfg, download, client))


def _cifar_plan(source: str, cfg: DataConfig, download: bool, client=None) -> Plan:
    path = resolve_source(source, cfg, download or cfg.download)
    # Shapes and chunk sizes must be known before anything is computed: the scan reads every
    # batch file once here, on the client, validating it (so bad data fails before a graph
    # runs) and counting images and classes; the load- tasks then read each file once more.
    catalog = cifar.scan(path, cfg.label_kind, cfg.dataset)
    return Plan(catalog.train, catalog.test, catalog.label_names, catalog.class_counts_train,
                (catalog.layout, cfg.label_kind, catalog.stamp), path, cifar.load)


def _synthetic_reader_plan(source: str, cfg: DataConfig, download: bool, client=None) -> Plan:
    return _synthetic_plan(*parse_synthetic(source), seed=SYNTHETIC_SEED)


def _synthetic_plan(n_train: int, n_test: int, seed: int) -> Plan:
    # Five training chunks like the five batch files (fewer when there are fewer images).
    sizes = cifar.split_sizes(n_train, min(cifar.TRAIN_BATCHES, n_train))
    train = tuple(cifar.SyntheticChunk(seed, "train", i, n) for i, n in enumerate(sizes))
    test = (cifar.SyntheticChunk(seed, "test", 0, n_test),)
    counts = sum(np.bincount(cifar.synthetic_labels(seed, "train", c.index, c.n), minlength=10)
                 for c in train)
    return Plan(train, test, cifar.CIFAR10_LABEL_NAMES, tuple(int(c) for c in counts),
                ("synthetic", seed, n_train, n_test), f"synthetic:{n_train}:{n_test}", cifar.load)


# The reader registry, tried in order: the first that claims a source plans it. A new format is
# one module with a Reader and its line here.
READERS: tuple[Reader, ...] = (
    arrays.ARRAYS,  # train(config, data=...): Dask / NumPy arrays, Chainer datasets
    Reader("synthetic", lambda source, cfg: parse_synthetic(source) is not None,
           _synthetic_reader_plan, checks_on_driver=True, image_side=32),
    FILE_LIST,  # lines "path label" (.txt, .lst, ...)
    IMAGE_FOLDER,  # a directory of class folders without CIFAR data in it
    Reader("cifar", lambda source, cfg: True, _cifar_plan,  # python, binary, CIFAR-100, tarballs
           checks_on_driver=True, image_side=32, kinds=("cifar10", "cifar100")),
)
KINDS: tuple[str, ...] = tuple(k for r in READERS for k in r.recorded())  # data.dataset's values


def facts(kind: str) -> Reader:
    """The reader whose runs record ``kind``; DataError for a kind no reader records.

    >>> facts("image-folder").eval_split, facts("cifar100").name, facts("arrays").refindable
    ('val', 'cifar', False)
    """
    found = next((r for r in READERS if kind in r.recorded()), None)
    if not found:
        raise DataError(f"data.dataset must be one of {', '.join(KINDS)} (what a run's data was), "
                        f"got {str(kind)[:60]!r}")
    return found


def resolve_source(source: str, cfg: DataConfig, download: bool = False) -> str:
    """The path to scan for ``source``: the path itself, or the official archive in the cache.

    Downloads (MD5-checked) only with ``download``: a dataset name (``cifar10``, ...) missing from
    the cache, a missing official archive path, or a directory without CIFAR data in it.
    """
    path = os.path.expanduser(source)
    if source in DATASET_NAMES and not os.path.exists(path):
        dataset, fmt = DATASET_NAMES[source]
        cached = os.path.join(default_cache_dir(cfg.cache_dir), ARCHIVES[dataset, fmt][0])
        if download:
            return fetch(dataset, fmt, cfg.cache_dir)
        if os.path.isfile(cached):
            return cached
        raise DataError(f"{source}: not downloaded yet (no {cached}); pass --download to fetch "
                        "the official archive")
    if download and os.path.isdir(path):
        try:
            cifar.locate(path, cfg.dataset)
        except DataError:  # nothing there yet: use it as the download directory
            return fetch(cfg.dataset, "python", path)
    if download and not os.path.exists(path):
        by_name = {name: key for key, (name, _) in ARCHIVES.items()}
        name = os.path.basename(path.rstrip(os.sep))
        if name in by_name:
            return fetch(*by_name[name], cache_dir=os.path.dirname(os.path.abspath(path)))
        return fetch(cfg.dataset, "python", path)
    if not os.path.exists(path):
        raise DataError(f"{source}: no such file or directory (expected synthetic, "
                        "synthetic:N:M, a CIFAR directory or tarball, an image folder, a file "
                        "list, or --download)")
    return path


def default_cache_dir(configured: str | None = None) -> str:
    """Where downloads go: ``configured``, else ``$DASK_CHAINER_CACHE``, else
    ``~/.cache/dask-chainer-pipeline``."""
    return os.path.expanduser(configured or os.environ.get(CACHE_ENV)
                              or "~/.cache/dask-chainer-pipeline")


def fetch(dataset: str = "cifar10", fmt: str = "python", cache_dir: str | None = None) -> str:
    """Download the official archive into the cache (MD5-checked) unless it is there; return its path.

    A cached file with the right MD5 is used without touching the network; a wrong download is
    deleted and reported as DataError.
    """
    if (dataset, fmt) not in ARCHIVES:
        raise DataError(f"no official archive for dataset {dataset!r} in format {fmt!r} "
                        f"(have {', '.join('/'.join(k) for k in ARCHIVES)})")
    name, md5 = ARCHIVES[dataset, fmt]
    directory, url = default_cache_dir(cache_dir), BASE_URL + name
    import pooch  # only the download path needs it
    logger = pooch.get_logger()
    level = logger.level
    logger.setLevel(logging.INFO if sys.stderr.isatty() else logging.WARNING)
    try:
        return pooch.retrieve(url, known_hash=f"md5:{md5}", fname=name, path=directory,
                              progressbar=sys.stderr.isatty())
    except ValueError as exc:  # pooch: hash mismatch (the download is deleted)
        raise DataError(f"{url}: downloaded file failed the MD5 check (expected {md5}); "
                        f"it was not kept ({os_reason(exc)[:160]})") from None
    except Exception as exc:  # requests' connection and HTTP errors, OSError writing the cache
        raise DataError(f"cannot download {url} ({download_failure(exc)}); offline, copy {name} "
                        f"(MD5 {md5}) into {directory}/ or give --data a CIFAR directory or "
                        "tarball") from None
    finally:
        logger.setLevel(level)


def _causes(exc: BaseException):
    """``exc`` and what it wraps: causes, contexts, urllib3's ``reason``, exceptions in args."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        wrapped = [getattr(e, "reason", None), e.__cause__, e.__context__, *e.args]
        todo.extend(w for w in wrapped if isinstance(w, BaseException))


def download_failure(exc: BaseException) -> str:
    """Why a download failed, in a few whole words (not the library's nested repr).

    >>> import socket
    >>> download_failure(OSError(socket.gaierror(-3, "Temporary failure in name resolution")))
    'no network: the host name does not resolve'
    >>> download_failure(RuntimeError("x " * 200)).endswith("...")
    True
    """
    import socket
    for e in _causes(exc):
        name = type(e).__name__
        if isinstance(e, socket.gaierror) or name == "NameResolutionError":
            return "no network: the host name does not resolve"
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if isinstance(e, TimeoutError) or "Timeout" in name:
            return "no answer: the connection timed out"
        if name == "HTTPError" and getattr(e, "response", None) is not None:
            return f"HTTP status {e.response.status_code}"
        if isinstance(e, OSError) and e.strerror and not isinstance(e, ConnectionError):
            return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    text = one_line(exc, kind=False)
    return text if len(text) <= 120 else text[:120].rsplit(" ", 1)[0] + " ..."


# --------------------------------------------------------------------------------------------
# The graph


def _arrays(plan: Plan, chunks: tuple, split: str) -> tuple[da.Array, da.Array]:
    """One read task (``load-`` or ``decode-``) per chunk, and the images and labels arrays that
    pick from them."""
    token = tokenize(plan.ident, split)[:8]
    load, images, labels = (keys.prefix(name, token) for name in (plan.stage, "images", "labels"))
    load_layer = {(load, i): Task((load, i), plan.read, chunk) for i, chunk in enumerate(chunks)}
    image_layer = {(images, i, 0, 0, 0): Task((images, i, 0, 0, 0), operator.getitem,
                                              TaskRef((load, i)), 0) for i in range(len(chunks))}
    label_layer = {(labels, i): Task((labels, i), operator.getitem, TaskRef((load, i)), 1)
                   for i in range(len(chunks))}
    sizes = tuple(chunk.n for chunk in chunks)

    def graph(name, layer):
        return HighLevelGraph({load: load_layer, name: layer}, {load: set(), name: {load}})

    shape = tuple((d,) for d in plan.image_shape)
    return (da.Array(graph(images, image_layer), images, (sizes, *shape),
                     meta=np.empty((0, 0, 0, 0), np.uint8)),
            da.Array(graph(labels, label_layer), labels, (sizes,),
                     meta=np.empty((0,), np.int32)))


def row_blocks(array: da.Array, size: int) -> da.Array:
    """``array.rechunk({0: size})``: blocks of ``size`` rows (the last shorter), the same rows, cut
    by our own task (``rows.take_rows``) so that the workers holding them import no
    ``dask.array``. An array split along another axis too is left to ``rechunk``.

    >>> x = da.from_array(np.arange(10), chunks=4)
    >>> y = row_blocks(x, 3)
    >>> y.chunks, y.compute().tolist() == list(range(10)), y.name.startswith("labels-")
    (((3, 3, 3, 1),), True, True)
    """
    n = array.shape[0]
    if n == 0 or any(len(c) > 1 for c in array.chunks[1:]):
        return array.rechunk({0: size})
    wanted = tuple(min(size, n - lo) for lo in range(0, n, size))
    if array.chunks[0] == wanted:
        return array
    name = keys.prefix("images" if array.ndim > 1 else "labels", tokenize(array.name, size)[:8])
    starts = np.cumsum((0,) + array.chunks[0]).tolist()
    blocks = list(zip(block_keys(array), starts, starts[1:]))  # (key, first row, end row)
    layer = {}
    for j, lo in enumerate(range(0, n, size)):
        hi, key = min(lo + size, n), (name, j) + (0,) * (array.ndim - 1)
        inside = [(k, a, b) for k, a, b in blocks if a < hi and b > lo]
        layer[key] = Task(key, rows.take_rows,
                          tuple((max(lo, a) - a, min(hi, b) - a) for _, a, b in inside),
                          *(TaskRef(k) for k, _, _ in inside))
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[array])
    return da.Array(graph, name, (wanted, *array.chunks[1:]), meta=array._meta)


def block_keys(array: da.Array) -> list:
    """The keys of ``array``'s blocks along its first axis (its first block along the others)."""
    found = array.__dask_keys__()
    while isinstance(found, list) and found and isinstance(found[0], list):
        found = [k[0] if isinstance(k, list) else k for k in found]
    return found
