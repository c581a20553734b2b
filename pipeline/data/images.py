"""Image folders and file lists as readers: ``scan-`` tasks check the files, ``decode-`` tasks decode them.

The format code is pure (``pipeline.data.imagefolder``); this module wires it into graphs::

    ("scan-<token>", i)              -> FileInfo of each file in chunk i   (before training: any
                                        bad file ends the run here with one line, exit 2)
    ("decode-<token>", i)            -> (images, labels) of chunk i         the dataset's blocks
    ("decode-<token>", r, k, p)      -> images of piece p of replica k's    when the training set
                                        shard in round r                    is not cached

The scan runs on the cluster when a client is given (or is the default), otherwise on local
threads (Pillow releases the GIL while it decodes). Whether decoded training images stay on the
workers is decided once the cluster is known (:func:`cache_decision`).
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import numpy as np

from pipeline.data import imagefolder
from pipeline.core import keys
from pipeline.core.config_data import DataConfig
from pipeline.core.errors import DataError
from pipeline.data.readers import Plan, Reader
from pipeline.core.rng import rng_for

DEFAULT_SIZE = 64  # --image-size of image sources when none is given (pixels)
CACHE_SHARE = 0.25  # cache when the decoded training set needs at most this share of the
#                     smallest worker's memory limit (each augmenting worker may hold a copy)


class Stream(NamedTuple):
    """The training split as files, for decoding each round's shard again (no cache)."""
    files: tuple  # imagefolder.ImageFile, in dataset row order
    size: int
    crop: float
    max_pixels: int
    piece: int  # images per decode- task
    cache: str  # data.cache: auto | on | off


# --------------------------------------------------------------------------------------------
# Readers


def claims_list(source: str, cfg: DataConfig) -> bool:
    """A regular file named like a list (``.txt``, ``.lst``, ...) is a file list."""
    path = os.path.expanduser(source)
    return path.lower().endswith(imagefolder.LIST_EXTENSIONS) and not os.path.isdir(path)


def claims_folder(source: str, cfg: DataConfig) -> bool:
    """A directory without CIFAR data in it, or with a ``train/`` folder (CIFAR-100's ``train``
    is a file), is an image folder."""
    from pipeline.data import cifar
    path = os.path.expanduser(source)
    if not os.path.isdir(path):
        return False
    if os.path.isdir(os.path.join(path, "train")):
        return True
    try:
        cifar.locate(path, cfg.dataset)
    except DataError:
        return True
    return False


def plan_list(source: str, cfg: DataConfig, download: bool = False, client=None) -> Plan:
    path = os.path.abspath(os.path.expanduser(source))
    if not os.path.exists(path):
        raise DataError(f"{source}: no such file list")
    train = imagefolder.read_file_list(path, cfg.image_root)
    return _plan(train, None, cfg, "file-list", path, client)


def plan_folder(source: str, cfg: DataConfig, download: bool = False, client=None) -> Plan:
    root = os.path.abspath(os.path.expanduser(source))
    if not imagefolder.class_folders(root):
        raise DataError(f"{root}: no CIFAR data here and no class subfolders (expected "
                        "cifar-10-batches-py/, cifar-10-batches-bin/, cifar-100-python/, an "
                        "official .tar.gz, or an image folder root/<class>/<image>)")
    train, val = imagefolder.folder_splits(root)
    return _plan(train, val, cfg, "image-folder", root, client)


FILE_LIST = Reader("file-list", claims_list, plan_list, checks_on_driver=False,
                   eval_split="val", image_files=True)
IMAGE_FOLDER = Reader("image-folder", claims_folder, plan_folder, checks_on_driver=False,
                      eval_split="val", image_files=True)


def _val_listing(cfg: DataConfig, class_names: tuple) -> imagefolder.Listing:
    """The explicit val split (data.val_source): a folder or a file list with the train classes."""
    path = os.path.abspath(os.path.expanduser(cfg.val_source))
    if os.path.isdir(path):
        return imagefolder.list_folder(path, class_names)
    if not os.path.exists(path):
        raise DataError(f"data.val_source {cfg.val_source}: no such file or directory")
    return imagefolder.read_file_list(path, cfg.image_root, class_names=class_names)


def _plan(train, val, cfg: DataConfig, kind: str, source: str, client) -> Plan:
    size = cfg.image_size or DEFAULT_SIZE
    if cfg.val_source:
        val = _val_listing(cfg, train.class_names)
    skipped = {"train": dict(train.skipped), "val": dict(val.skipped) if val else {}}
    if val is None:
        train, val = imagefolder.split_listing(train, cfg.val_fraction,
                                               rng_for(cfg.split_seed, "split"))
    infos = scan(train.files + val.files, cfg, client)
    counts = np.bincount([f.label for f in train.files], minlength=len(train.class_names))
    ident = (kind, imagefolder.fingerprint(train.files), imagefolder.fingerprint(val.files),
             size, cfg.max_pixels)
    info = {"class_counts": {"train": imagefolder.class_counts(train),
                             "val": imagefolder.class_counts(val)},
            "skipped": skipped, **imagefolder.summary(infos)}
    return Plan(_chunks(train.files, size, 1.0, cfg), _chunks(val.files, size,
                                                              imagefolder.EVAL_CROP, cfg),
                train.class_names, tuple(int(c) for c in counts), ident, source,
                read=imagefolder.decode_chunk, stage="decode", image_shape=(3, size, size),
                info=info, stream=Stream(train.files, size, 1.0, cfg.max_pixels,
                                         cfg.decode_chunk, cfg.cache))


def _chunks(files: tuple, size: int, crop: float, cfg: DataConfig) -> tuple:
    """Nearly equal chunks of at most ``data.decode_chunk`` files (balanced over workers)."""
    bounds = _bounds(len(files), cfg.decode_chunk)
    return tuple(imagefolder.DecodeChunk(files[lo:hi], size, crop, cfg.max_pixels)
                 for lo, hi in zip(bounds[:-1], bounds[1:]))


def _bounds(n: int, most: int) -> list[int]:
    """Boundaries of ceil(n / most) nearly equal parts of range(n).

    >>> _bounds(10, 4)
    [0, 3, 6, 10]
    """
    parts = max(1, math.ceil(n / most))
    return [n * i // parts for i in range(parts)] + [n] if n else [0]


# --------------------------------------------------------------------------------------------
# The scan- graph


def scan(files: tuple, cfg: DataConfig, client=None) -> tuple:
    """Check every file in ``scan-`` tasks; DataError naming the first bad one. Returns FileInfos."""
    import dask
    from dask.base import tokenize
    bounds = _bounds(len(files), cfg.decode_chunk)
    token = tokenize(imagefolder.fingerprint(files), cfg.max_pixels)[:8]
    parts = [dask.delayed(imagefolder.scan_files, pure=True)(
        files[lo:hi], cfg.max_pixels, dask_key_name=keys.make("scan", token, i))
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]
    if client is not None:
        results = client.gather(client.compute(parts))
    else:
        results = dask.compute(*parts)
    infos = tuple(info for part in results for info in part)
    problem = imagefolder.first_problems(files, infos)
    if problem:
        raise DataError(problem)
    return infos


# --------------------------------------------------------------------------------------------
# Cache or stream


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def cache_decision(stream: Stream, n_train: int, worker_limits: list) -> tuple[bool, str]:
    """Keep the decoded training images on the workers? ``(cache, one line saying why)``.

    ``worker_limits``: each worker's memory limit in bytes (0 = none).

    >>> s = Stream((), 64, 1.0, 1, 128, "auto")
    >>> cache_decision(s, 1000, [4 << 30])
    (True, 'decoded training images: 11.7 MiB (1000 x 3x64x64 uint8) per worker that augments; cached on the workers (data.cache auto)')
    """
    need = n_train * 3 * stream.size * stream.size
    limits = [m for m in worker_limits if m]
    fits = not limits or need <= CACHE_SHARE * min(limits)
    cache = stream.cache == "on" or (stream.cache == "auto" and fits)
    text = (f"decoded training images: {_fmt_bytes(need)} ({n_train} x 3x{stream.size}x"
            f"{stream.size} uint8) per worker that augments; ")
    if cache:
        return True, text + f"cached on the workers (data.cache {stream.cache})"
    why = ("data.cache off" if stream.cache == "off" else
           f"more than {CACHE_SHARE:.0%} of the smallest worker's {_fmt_bytes(min(limits))}")
    return False, text + f"decoded again every epoch ({why})"


def worker_memory_limits(client) -> list:
    return [w.get("memory_limit") or 0
            for w in client.scheduler_info(n_workers=-1)["workers"].values()]


def decode_images(chunk: imagefolder.DecodeChunk) -> np.ndarray:
    """The per-round ``decode-`` task: ``(n, 3, size, size) uint8`` (labels stay on the host)."""
    return imagefolder.decode_chunk(chunk)[0]


def submit_decode(submit, key, stream: Stream, indices: np.ndarray, rnd: int, replica: int,
                  resources: dict | None):
    """Submit the decode- tasks of one replica's shard (dataset rows ``indices``, in order).

    ``submit(func, *args, key=, resources=)`` and ``key(stage, *coords)`` are the graph's.
    Returns ``(image futures, label arrays, starts)``: the blocks of the shard, in shard order.
    """
    bounds = _bounds(len(indices), stream.piece)
    blocks, labels = [], []
    for p, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        files = tuple(stream.files[i] for i in indices[lo:hi])
        chunk = imagefolder.DecodeChunk(files, stream.size, stream.crop, stream.max_pixels)
        blocks.append(submit(decode_images, chunk, key=key("decode", rnd, replica, p),
                             resources=resources))
        labels.append(np.array([f.label for f in files], np.int32))
    return blocks, labels, tuple(bounds[:-1])
