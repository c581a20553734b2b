"""Finding a CIFAR source (a tarball or a directory) and scanning it: every batch read once,
validated and counted into a :class:`~pipeline.data.cifar.layout.Catalog`."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from pipeline.core.errors import DataError
from pipeline.core.files import os_reason
from pipeline.data.cifar.archive import read_archive, read_file
from pipeline.data.cifar.layout import LAYOUTS, BatchFile, Catalog, Layout, layout_of_top
from pipeline.data.cifar.parse import parse_batch, parse_meta


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
        raise DataError(f"{directory}: cannot list the directory ({os_reason(exc)})") from None
    _check_names(directory, lay, names)
    paths = {name: os.path.join(directory, name) for name in (*lay.train, *lay.test, lay.meta)}
    files = {name: BatchFile(lay.key, path, None, label_kind) for name, path in paths.items()}
    catalog = _catalog(lay, lambda name: read_file(paths[name], lay), files, (), label_kind)
    return catalog._replace(stamp=tuple(_stamp(path) for path in paths.values()))


def _scan_archive(path: str, label_kind: str) -> Catalog:
    top, members, seen = read_archive(path, None)
    lay = layout_of_top(top)
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


def _stamp(path: str) -> tuple:
    st = os.stat(path)
    return path, st.st_size, st.st_mtime_ns
