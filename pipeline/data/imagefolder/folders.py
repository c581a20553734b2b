"""Image folders: ``root/<class>/...`` listed (classes, nested folders, what is skipped), and the
``train/`` / ``val/`` splits of a folder (a Tiny-ImageNet ``val/`` read as its file list)."""
from __future__ import annotations

import os
from collections import Counter

from pipeline.core.errors import DataError
from pipeline.core.files import os_reason
from pipeline.data.imagefolder.layout import (EXTENSIONS, LIST_EXTENSIONS, RUN_MARKER, ImageFile,
                                              Listing, listed)
from pipeline.data.imagefolder.lists import read_file_list


def _hidden(name: str) -> bool:
    return name.startswith(".")

def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_run_dir(path: str) -> bool:
    return os.path.lexists(os.path.join(path, RUN_MARKER))


def class_folders(root: str) -> list[str]:
    """Names of the non-hidden subfolders of ``root`` (the classes) in :func:`class_order`; a
    run directory of ours (an ``--out`` placed inside the data) is not one."""
    try:
        entries = list(os.scandir(root))
    except OSError as exc:
        raise DataError(f"{root}: cannot list the directory ({os_reason(exc)})") from None
    return class_order([e.name for e in entries if not _hidden(e.name) and _is_dir(e)
                        and not _is_run_dir(e.path)])


def class_order(names: list) -> list:
    """Sorted names; numbered classes in numeric order, so class ``10`` is index 10 as in a list
    labelled by numbers (as strings they sorted ``0, 1, 10, 2``).

    >>> class_order(["2", "10", "0", "1"]), class_order(["b", "10", "a", "2"])
    (['0', '1', '2', '10'], ['10', '2', 'a', 'b'])
    """
    if names and all(n.isascii() and n.isdigit() for n in names):
        return sorted(names, key=lambda n: (len(n.lstrip("0")), n.lstrip("0"), n))
    return sorted(names)


def _walk(folder: str):
    """``(directory, sorted file names, hidden folders skipped)`` below ``folder``, depth first
    with sorted folders, as
    ``os.walk`` top-down; without recursion (a class folder nested 1,200 deep overflowed
    ``os.walk``'s), symlinked folders, hidden folders and run directories of ours skipped."""
    stack = [folder]
    while stack:
        here = stack.pop()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError as exc:
            raise DataError(f"{here}: cannot list the directory ({os_reason(exc)})") from None
        folders = [e for e in entries if _is_dir(e)]
        dirs = [e for e in folders if not _hidden(e.name)]
        yield here, [e.name for e in entries if not _is_dir(e)], len(folders) - len(dirs)
        stack.extend(e.path for e in reversed(dirs)
                     if not e.is_symlink() and not _is_run_dir(e.path))


def skip_kind(name: str) -> str | None:
    """Why a file named ``name`` in a class folder is not an image (None: it is one).

    >>> [skip_kind(n) for n in ("a.JPEG", "n01_boxes.txt", ".DS_Store", "._a.jpg", "README")]
    [None, '.txt', 'hidden file', 'hidden file', 'no extension']
    """
    if _hidden(name):
        return "hidden file"
    if name.lower().endswith(EXTENSIONS):
        return None
    ext = os.path.splitext(name)[1].lower()
    return ext if ext and len(ext) <= 12 and ext.isprintable() else "no extension"


def _class_files(folder: str, label: int, skipped: Counter) -> list[ImageFile]:
    """Every image below ``folder`` (nested folders too, symlinked folders not followed); what
    is not an image by its name is counted in ``skipped`` (see :func:`skip_kind`)."""
    found = []
    for here, names, hidden in _walk(folder):
        if hidden:
            skipped["hidden folder"] += hidden
        for name in names:
            kind = skip_kind(name)
            if kind is not None:
                skipped[kind] += 1
                continue
            found.append(listed(os.path.join(here, name), label))
    return found


def list_folder(root: str, class_names: tuple | None = None) -> Listing:
    """The images of ``root/<class>/...``; ``class_names`` (a val split) must be a subset of
    the given names and keeps their indices. DataError for no class, one class, an empty class."""
    names = class_folders(root)
    if class_names is None:
        if len(names) < 2:
            found = f"only {names[0]!r}" if names else "none"
            raise DataError(f"{root}: an image folder needs at least 2 class subfolders "
                            f"(root/<class>/<image>), found {found}")
        class_names = tuple(names)
    index = {name: i for i, name in enumerate(class_names)}
    files, skipped = [], Counter()
    for name in names:
        if name not in index:
            raise DataError(f"{os.path.join(root, name)}: class {name!r} is not one of the "
                            f"training classes ({', '.join(class_names)})")
        found = _class_files(os.path.join(root, name), index[name], skipped)
        if not found:
            raise DataError(f"{os.path.join(root, name)}: empty class folder (no image files: "
                            f"{', '.join(EXTENSIONS)})")
        files += found
    if not files:
        raise DataError(f"{root}: no class subfolders with images")
    return Listing(tuple(files), tuple(class_names), root, tuple(skipped.most_common()))


def folder_splits(root: str) -> tuple[Listing, Listing | None]:
    """``(train, val or None)`` of an image folder: ``train/`` and ``val/`` when present (val
    optional), else the whole folder as the training set."""
    train_dir, val_dir = os.path.join(root, "train"), os.path.join(root, "val")
    if not os.path.isdir(train_dir):
        return list_folder(root), None
    train = list_folder(train_dir)
    if not os.path.isdir(val_dir):
        return train, None
    annotations = _val_list(val_dir, train.class_names)
    if annotations is not None:  # Tiny-ImageNet's val/: images/ and a list naming their classes
        return train, read_file_list(*annotations, class_names=train.class_names)
    return train, list_folder(val_dir, train.class_names)


def _val_list(val_dir: str, class_names: tuple) -> tuple | None:
    """``(list, image root)`` when ``val_dir`` holds one file list beside one folder that is not
    a training class (``val/val_annotations.txt`` + ``val/images/``), else None."""
    folders = class_folders(val_dir)
    if len(folders) != 1 or folders[0] in class_names:
        return None
    lists = [e.name for e in os.scandir(val_dir) if e.is_file() and not _hidden(e.name)
             and e.name.lower().endswith(LIST_EXTENSIONS)]
    if len(lists) != 1:
        return None
    return os.path.join(val_dir, lists[0]), os.path.join(val_dir, folders[0])
