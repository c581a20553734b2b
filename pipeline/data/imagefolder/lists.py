"""File lists (Chainer's ``LabeledImageDataset``): lines ``path label``, the label an integer or a
class name, read into a Listing with every bad line named ``LIST:LINE``."""
from __future__ import annotations

import os
import re

import numpy as np

from pipeline.core.errors import DataError
from pipeline.core.files import read_capped
from pipeline.data.imagefolder.layout import MAX_LIST_BYTES, Listing, listed


def read_file_list(path: str, root: str | None = None, n_classes: int | None = None,
                   class_names: tuple | None = None) -> Listing:
    """A file list -> Listing. ``root``: where relative paths start (default: the list's folder).

    Lines are ``path label`` (the label the last field; a path may hold spaces) or, with tabs or
    with more fields after an existing path, ``path label extra...`` (extra columns ignored, as
    in Tiny-ImageNet's ``val_annotations.txt``). A label is an integer or a class name: names
    of a training list are its sorted distinct names (torchvision's order); ``class_names`` (a
    val list: the training split's) maps names to indices, and fixes ``n_classes``; a list whose
    every label is one of ``class_names`` is read by name (``2`` is the class named "2"). DataError
    naming ``LIST:LINE`` for a bad line, a missing file, a label out of range or an unknown name.
    """
    text = _read_text(path)
    root = os.path.dirname(os.path.abspath(path)) if root is None else root
    if class_names is not None:
        n_classes = len(class_names)
    rows = []
    for number, line in enumerate(_lines(text), 1):
        line = line.strip(" \t")
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        image, label = _fields(line, root, where)
        try:
            rows.append((where, listed(os.path.join(root, image), 0), label, line))
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
    if not rows:
        raise DataError(f"{path}: the file list names no image")
    if not _is_int(rows[0][2]) or (class_names and {r[2] for r in rows} <= set(class_names)):
        return _named(rows, path, class_names)  # a val list naming numbered classes too
    files, largest = [], (-1, "")
    for where, f, label, line in rows:
        if not _is_int(label) and any(ch.isalpha() for ch in label):
            raise DataError(f"{where}: label {label[:80]!r} names a class, but {rows[0][0]} has "
                            f"a number ({rows[0][2]}): a list uses numbers or names, not both")
        if not _is_int(label):
            raise DataError(f"{where}: expected 'path label' with an integer label, got "
                            f"{line[:80]!r}")
        label = int(label)
        if label < 0 or (n_classes is not None and label >= n_classes):
            limit = f"0..{n_classes - 1}" if n_classes else ">= 0"
            raise DataError(f"{where}: label {label} is out of range (labels are {limit})")
        largest = max(largest, (label, where))
        files.append(f._replace(label=label))
    if n_classes is None and largest[0] >= len(files):  # before anything is sized by it
        raise DataError(f"{largest[1]}: label {largest[0]} is out of range: the list names "
                        f"{len(files)} images, so with every class present labels are at most "
                        f"{len(files) - 1}")
    listing = _labelled(tuple(files), path, n_classes)
    return listing._replace(class_names=tuple(class_names)) if class_names else listing


def _fields(line: str, root: str, where: str) -> tuple[str, str]:
    """``(path, label)`` of one stripped line (see :func:`read_file_list`). Fields part at tabs,
    else at spaces: never at the other characters ``str.split`` breaks on (VT, FF, U+2028),
    which a path may hold."""
    if "\t" in line:
        parts = [p.strip(" ") for p in line.split("\t")]
    else:
        parts = [p for p in line.split(" ") if p]
        if len(parts) > 2 and not os.path.isfile(os.path.join(root, parts[0])):
            match = _LABELLED.fullmatch(line)  # a path with spaces: the label the last field
            parts = list(match.groups()) if match else parts
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise DataError(f"{where}: expected 'path label' (an integer label or a class name), "
                        f"got {line[:80]!r}")
    if "\0" in line:  # os.stat's "embedded null byte" named neither the list nor the line
        raise DataError(f"{where}: a NUL byte in {line[:80]!r}; no path or class name holds one")
    return parts[0], parts[1]


def _named(rows: list, path: str, class_names: tuple | None) -> Listing:
    """A list labelled by class names: indices through ``class_names`` (else the sorted names)."""
    names = tuple(class_names) if class_names else tuple(sorted({r[2] for r in rows}))
    index = {name: i for i, name in enumerate(names)}
    numbered = [r for r in rows if _is_int(r[2]) and r[2] not in index]
    if numbered:
        where, _, label, _ = numbered[0]
        raise DataError(f"{where}: label {label!r} is a number, but {rows[0][0]} names a class "
                        f"({rows[0][2]!r}): a list uses numbers or names, not both")
    files = []
    for where, f, label, _ in rows:
        if label not in index:
            shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5
                                              else "")
            raise DataError(f"{where}: class {label[:80]!r} is not one of the training classes "
                            f"({shown})")
        files.append(f._replace(label=index[label]))
    if class_names is None and len(names) < 2:
        raise DataError(f"{path}: a file list needs at least 2 classes, found only {names[0]!r}")
    return Listing(tuple(files), names, path)


# 'path label': the label is the last field after spaces or tabs; the path may hold spaces
_LABELLED = re.compile(r"(.+?)[ \t]+([^ \t]+)")


def _lines(text: str) -> list[str]:
    """The lines of a file list: split at ``\\n`` only (a ``\\r`` before it dropped), never at
    the other characters ``str.splitlines`` breaks on (VT, FF, U+2028, a lone CR), which a
    path may hold.

    >>> _lines("a\\x0bb.png 0\\r\\nc\\u2028d.png 1\\n")
    ['a\\x0bb.png 0', 'c\\u2028d.png 1']
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [x[:-1] if x.endswith("\r") else x for x in lines]


def _labelled(files: tuple, where: str, n_classes: int | None) -> Listing:
    counts = np.bincount([f.label for f in files])
    if n_classes is None:
        n_classes = len(counts)
        empty = np.flatnonzero(counts == 0)
        if n_classes < 2:
            raise DataError(f"{where}: a file list needs at least 2 classes (labels 0 and 1), "
                            f"found only label {n_classes - 1}")
        if len(empty):
            raise DataError(f"{where}: label {n_classes - 1} is out of range: labels must be "
                            f"0..K-1 with every class present, and {_ranges(empty)} have no image")
    return Listing(files, tuple(str(i) for i in range(n_classes)), where)


def _ranges(values) -> str:
    """'class 3' or 'classes 2, 5..7'."""
    values, runs = [int(v) for v in values], []
    start = prev = values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        runs.append(str(start) if start == prev else f"{start}..{prev}")
        if v is not None:
            start = prev = v
    return ("class " if len(values) == 1 else "classes ") + ", ".join(runs)


def _is_int(text: str) -> bool:
    """An ASCII integer of at most 18 digits with one optional sign ('²' and '+-1' are not).

    >>> [_is_int(x) for x in ("7", "-1", "+3", "\u00b2", "+-1", "\u0663", "1" * 19)]
    [True, True, True, False, False, False, False]
    """
    return _INT.fullmatch(text) is not None


_INT = re.compile(r"[+-]?[0-9]{1,18}")


def _read_text(path: str) -> str:
    raw = read_capped(path, MAX_LIST_BYTES, "a file list")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not a UTF-8 text file list ({exc.reason} at byte "
                        f"{exc.start})") from None
