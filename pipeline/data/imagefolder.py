"""Image folders and file lists: list and check the files, decode them to square uint8 NCHW arrays.

Pure format code (no dask), the peer of ``pipeline.data.cifar``; ``pipeline.data.images`` maps
:func:`scan_files` (``scan-`` tasks) and :func:`decode_chunk` (``decode-`` tasks) over chunks of
files on the workers.

Sources:

* an image folder ``root/<class>/<image>`` (ImageNet / torchvision ``ImageFolder`` style; classes
  are the sorted names of the subfolders, files may sit in nested folders of a class, as
  Tiny-ImageNet's ``<class>/images/*.JPEG``), optionally split as ``root/train/<class>/...`` and
  ``root/val/<class>/...`` (or ``root/val/`` holding one folder of images and one file list
  naming their classes, as Tiny-ImageNet's ``val/images/`` and ``val_annotations.txt``). As torchvision does, files without an image extension (a
  ``<wnid>_boxes.txt``, ``.xml`` annotations) are skipped, and so are hidden files and folders
  (``.DS_Store``, macOS ``._*`` files, ``.git/``); ``Listing.skipped`` counts them by kind;
* a file list (Chainer's ``LabeledImageDataset``): lines ``path label``, the label an integer
  ``0 <= label < K`` or a class name (Tiny-ImageNet's ``val_annotations.txt``: ``path<TAB>wnid
  <TAB>box...``, extra columns ignored), paths relative to a root directory (the list's own
  directory unless given); blank lines and lines starting with ``#`` are skipped; a path may
  contain spaces (the label is then the last field).

Every image becomes RGB: grayscale, bilevel, palette (transparency dropped), RGBA / LA (alpha
dropped, as torchvision's loader does), CMYK and YCbCr through Pillow's conversion; 16-bit
grayscale (``I;16``, ``I``) scaled from 0..65535 to 0..255 (Pillow reads 16-bit RGB PNGs as 8-bit
RGB itself). The EXIF orientation of photos is applied. Only the first frame of an animation is
used.

Safety: a file is read with ``pipeline.core.files.read_capped`` (never a FIFO or a device, never
more than a size cap) and given to Pillow from memory with the formats restricted to plain
raster ones (no EPS, which would run Ghostscript); the header's pixel count is checked against
``max_pixels`` before any pixel is decoded. Every problem is one line naming the file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import os
import re
import stat
import struct
from collections import Counter
from typing import NamedTuple

import numpy as np

from pipeline.core.errors import DataError
from pipeline.core.files import describe, os_reason, read_capped

# Formats Pillow may open (its plugin names). EPS/PS (Ghostscript), PDF and other exotic plugins
# are never tried, so a file named .jpg cannot reach them.
FORMATS = ("JPEG", "PNG", "BMP", "GIF", "TIFF", "WEBP", "PPM")
# Extensions an image file may have; other files inside a class folder are skipped (and counted).
EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm",
              ".pbm", ".pnm")
LIST_EXTENSIONS = (".txt", ".lst", ".list", ".tsv")  # a --data file with one of these is a file list
MAX_FILE_BYTES = 1 << 28  # 256 MiB: larger image files are refused before they are read
MAX_LIST_BYTES = 1 << 28  # a file list of ~5 M lines at most
MAX_PIXELS = 1 << 26  # default cap on width x height (67 M pixels, e.g. 8192 x 8192)
# Scans of a progressive JPEG decoded at most: encoders write ~10 (mozjpeg 9-12); each scan is a
# pass over the whole coefficient buffer, so 100,000 empty scans in 1 MB took ~8 minutes to decode.
MAX_JPEG_SCANS = 256
EVAL_CROP = 0.875  # fraction of the centred square kept for evaluation (torchvision's 224 / 256)
_ORIENTATION = 0x0112  # the EXIF tag


class ImageFile(NamedTuple):
    """One image as listed: enough for any worker that sees the same path to read it."""
    path: str
    label: int
    bytes: int  # file size when listed
    mtime_ns: int  # modification time when listed


class Listing(NamedTuple):
    """The files of one split and the class names, before any file was opened."""
    files: tuple  # ImageFile, in a fixed order (class, then path)
    class_names: tuple  # class index -> name
    where: str  # the folder or list it came from (for messages)
    skipped: tuple = ()  # (kind, count) of what a folder held besides images, most first:
    #                      kinds are extensions (".txt"), "no extension", "hidden file",
    #                      "hidden folder"


class FileInfo(NamedTuple):
    """What a scan found about one file: its header, or the one-line problem."""
    width: int
    height: int
    format: str
    mode: str
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class DecodeChunk:
    """The input of one ``decode-`` task: files, and how to decode them."""
    files: tuple  # ImageFile
    size: int  # side of the square output (pixels)
    crop: float = 1.0  # share of the centred square's side kept (1: all; EVAL_CROP for val)
    max_pixels: int = MAX_PIXELS

    @property
    def n(self) -> int:
        return len(self.files)


# --------------------------------------------------------------------------------------------
# Listing


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _listed(path: str, label: int) -> ImageFile:
    """An ImageFile for ``path``; DataError unless it is a regular file (symlinks followed)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DataError(f"{path}: {os_reason(exc)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{path}: is {describe(st.st_mode)}, expected a regular file")
    return ImageFile(path, label, st.st_size, st.st_mtime_ns)


# The file that marks a run directory of ours (pipeline.outputs.fs.MARKER): an --out inside the
# image folder is never read as a class or as images.
RUN_MARKER = ".dask-chainer-run"


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_run_dir(path: str) -> bool:
    return os.path.lexists(os.path.join(path, RUN_MARKER))


def class_folders(root: str) -> list[str]:
    """Sorted names of the non-hidden subfolders of ``root`` (the classes); a run directory of
    ours (an ``--out`` placed inside the data) is not one."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        raise DataError(f"{root}: cannot list the directory ({os_reason(exc)})") from None
    return [e.name for e in entries if not _hidden(e.name) and _is_dir(e)
            and not _is_run_dir(e.path)]


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
            found.append(_listed(os.path.join(here, name), label))
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


def read_file_list(path: str, root: str | None = None, n_classes: int | None = None,
                   class_names: tuple | None = None) -> Listing:
    """A file list -> Listing. ``root``: where relative paths start (default: the list's folder).

    Lines are ``path label`` (the label the last field; a path may hold spaces) or, with tabs or
    with more fields after an existing path, ``path label extra...`` (extra columns ignored, as
    in Tiny-ImageNet's ``val_annotations.txt``). A label is an integer or a class name: names
    of a training list are its sorted distinct names (torchvision's order); ``class_names`` (a
    val list: the training split's) maps names to indices, and fixes ``n_classes``. DataError
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
            rows.append((where, _listed(os.path.join(root, image), 0), label, line))
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
    if not rows:
        raise DataError(f"{path}: the file list names no image")
    if not _is_int(rows[0][2]):
        return _named(rows, path, class_names)
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
    return parts[0], parts[1]


def _named(rows: list, path: str, class_names: tuple | None) -> Listing:
    """A list labelled by class names: indices through ``class_names`` (else the sorted names)."""
    numbered = [r for r in rows if _is_int(r[2])]
    if numbered:
        where, _, label, _ = numbered[0]
        raise DataError(f"{where}: label {label!r} is a number, but {rows[0][0]} names a class "
                        f"({rows[0][2]!r}): a list uses numbers or names, not both")
    names = tuple(class_names) if class_names else tuple(sorted({r[2] for r in rows}))
    index = {name: i for i, name in enumerate(names)}
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


def split_listing(listing: Listing, fraction: float, rng: np.random.Generator
                  ) -> tuple[Listing, Listing]:
    """A stratified random split: per class, ``round(fraction * n)`` images (at least one when the
    class has two or more) go to the val split. The order inside each split stays the listing's.

    >>> files = tuple(ImageFile(f"{c}/{i}.jpg", c, 1, 0) for c in range(2) for i in range(10))
    >>> train, val = split_listing(Listing(files, ("a", "b"), "x"), 0.2, np.random.default_rng(0))
    >>> len(train.files), len(val.files), sorted(f.label for f in val.files)
    (16, 4, [0, 0, 1, 1])
    """
    labels = np.array([f.label for f in listing.files])
    to_val = np.zeros(len(labels), bool)
    for label in range(len(listing.class_names)):
        members = np.flatnonzero(labels == label)
        k = int(round(fraction * len(members)))
        k = min(max(k, 1 if len(members) > 1 else 0), len(members) - 1)
        to_val[rng.permutation(members)[:k]] = True
    if not to_val.any():
        raise DataError(f"{listing.where}: too few images for a val split of {fraction:g}")
    pick = lambda mask: tuple(f for f, m in zip(listing.files, mask) if m)  # noqa: E731
    return (listing._replace(files=pick(~to_val)), listing._replace(files=pick(to_val)))


def fingerprint(files) -> str:
    """A hash of paths, labels, sizes and mtimes: same fingerprint, same data."""
    digest = hashlib.sha1()
    for f in files:  # a name of non-UTF-8 bytes (caf\xe9.png) holds surrogates: its own bytes
        digest.update(f"{f.path}\0{f.label}\0{f.bytes}\0{f.mtime_ns}\n".encode(
            "utf-8", "surrogateescape"))
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Reading one file


def _open(path: str, data: bytes, max_pixels: int):
    """Pillow image of ``data`` (header only read), pixel count checked."""
    from PIL import Image, UnidentifiedImageError
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise DataError(f"{path}: not an image Pillow can read as {'/'.join(FORMATS)}") from None
    except Image.DecompressionBombError as exc:
        raise DataError(f"{path}: refused as a decompression bomb ({os_reason(exc)})") from None
    except (OSError, ValueError, SyntaxError, struct.error) as exc:
        raise DataError(f"{path}: corrupt or truncated image header ({os_reason(exc)})") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise DataError(f"{path}: empty image ({width}x{height})")
    if image.format == "JPEG" and (scans := jpeg_scans(data)) > MAX_JPEG_SCANS:
        raise DataError(f"{path}: a JPEG of {scans} scans, more than the {MAX_JPEG_SCANS} a "
                        "progressive JPEG needs (refused: each scan is another pass over the "
                        "whole image)")
    if width * height > max_pixels:
        raise DataError(f"{path}: {width}x{height} = {width * height} pixels, more than the cap "
                        f"of {max_pixels} (data.max_pixels)")
    return image


def jpeg_scans(data: bytes) -> int:
    """Start-of-scan markers in a JPEG stream: the header segments are skipped by their lengths
    up to the first scan; after it, 0xFF 0xDA can only be a marker (entropy-coded data stuffs
    every 0xFF with 0x00), so the rest is counted at C speed. An upper bound where a table
    between scans happens to hold those two bytes; a linear pass, never a decode.

    >>> jpeg_scans(b"\\xff\\xd8\\xff\\xe0\\x00\\x04\\xff\\xda\\xff\\xda\\x00\\x02..\\xff\\xda\\x00\\x02\\xff\\xd9")
    2
    """
    pos = 2  # after SOI
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
        elif marker == 0xDA:
            return 1 + data.count(b"\xff\xda", pos + 2)
        elif 0xD0 <= marker <= 0xD8 or marker == 0x01:  # no length
            pos += 2
        else:
            pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    return 0


def _load(path: str, image) -> None:
    """Decode the pixels (after any draft); a truncated or corrupt stream is a DataError."""
    from PIL import Image
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise DataError(f"{path}: refused as a decompression bomb ({os_reason(exc)})") from None
    except (OSError, ValueError, SyntaxError, IndexError, struct.error, EOFError,
            ZeroDivisionError) as exc:
        raise DataError(f"{path}: corrupt or truncated image ({os_reason(exc)})") from None


def to_rgb(image):
    """Any Pillow mode -> an RGB image (see the module docstring for what each mode becomes)."""
    from PIL import Image
    if image.mode == "RGB":
        return image
    if image.mode.startswith("I"):  # 16-bit grayscale (I;16, I;16B, I from PNG): 0..65535
        image = Image.fromarray(_scale_16_bit(np.asarray(image)), "L")
    elif image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    elif image.mode == "La":
        image = image.convert("LA")
    return image.convert("RGB")


def _scale_16_bit(values: np.ndarray, rows: int = 1 << 20) -> np.ndarray:
    """(H, W) 16- or 32-bit grayscale -> (H, W) uint8, 0..65535 scaled to 0..255 (rounded),
    in blocks of about ``rows`` pixels: a whole-image int64 temporary cost 8 bytes a pixel more
    (a 130 KB 16-bit PNG of 67 M pixels took 1.8 GB), this costs the uint8 result.

    >>> _scale_16_bit(np.array([[0, 129, 65535, 70000]], np.int32)).tolist()
    [[0, 1, 255, 255]]
    """
    out = np.empty(values.shape, np.uint8)
    step = max(1, rows // max(1, values.shape[1]))
    for top in range(0, values.shape[0], step):
        block = values[top:top + step].astype(np.int64)
        out[top:top + step] = np.clip((block + 128) // 257, 0, 255)
    return out


def scan_file(f: ImageFile, max_pixels: int = MAX_PIXELS) -> FileInfo:
    """Check one file the way decoding will read it: header, pixel cap, and every byte of the
    compressed stream (JPEGs decoded at 1/8 scale, which still reads all of it)."""
    try:
        data = read_capped(f.path, MAX_FILE_BYTES, "an image file")
        image = _open(f.path, data, max_pixels)
        info = (image.size[0], image.size[1], image.format or "?", image.mode)
        if image.format == "JPEG":
            image.draft(None, (1, 1))  # smallest DCT scale: fast, still the whole stream
        _load(f.path, image)
        return FileInfo(*info)
    except DataError as err:
        return FileInfo(0, 0, "", "", str(err))


def scan_files(files: tuple, max_pixels: int = MAX_PIXELS) -> tuple:
    """The ``scan-`` task: one :class:`FileInfo` per file, problems as values (never raises)."""
    return tuple(scan_file(f, max_pixels) for f in files)


def _box(width: int, height: int) -> tuple:
    """The centred square of the image, as a float box."""
    side = min(width, height)
    x0, y0 = (width - side) / 2, (height - side) / 2
    return (x0, y0, x0 + side, y0 + side)


def decode_file(f: ImageFile, size: int, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """One image -> (3, size, size) uint8: the centred square, resized (antialiased bilinear) to
    ``size``. JPEGs are decoded at the smallest DCT scale that keeps at least ``size`` pixels
    across the square (libjpeg's draft mode), several times cheaper than a full decode for
    photos much larger than ``size`` (benchmarks/decode.py)."""
    from PIL import Image
    data = read_capped(f.path, MAX_FILE_BYTES, "an image file")
    image = _open(f.path, data, max_pixels)
    orientation = _orientation(image)
    width, height = image.size
    if image.format == "JPEG":
        scale = size / min(width, height)
        image.draft("RGB" if image.mode == "RGB" else None,
                    (math.ceil(width * scale), math.ceil(height * scale)))
    _load(f.path, image)
    try:
        image = to_rgb(image)
        image = image.resize((size, size), Image.BILINEAR, box=_box(*image.size),
                             reducing_gap=3.0)
    except (OSError, ValueError) as exc:
        raise DataError(f"{f.path}: cannot convert {image.mode} to RGB "
                        f"({os_reason(exc)})") from None
    if orientation in _TRANSPOSES:
        image = image.transpose(_TRANSPOSES[orientation])
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def _orientation(image) -> int:
    try:
        return int(image.getexif().get(_ORIENTATION, 1))
    except Exception:  # a damaged EXIF block: keep the image as stored
        return 1


def _transposes() -> dict:
    from PIL import Image
    T = Image.Transpose
    return {2: T.FLIP_LEFT_RIGHT, 3: T.ROTATE_180, 4: T.FLIP_TOP_BOTTOM, 5: T.TRANSPOSE,
            6: T.ROTATE_270, 7: T.TRANSVERSE, 8: T.ROTATE_90}


_TRANSPOSES = _transposes()


def decode_chunk(chunk: DecodeChunk) -> tuple[np.ndarray, np.ndarray]:
    """The ``decode-`` task: ``(n, 3, size, size) uint8`` images and ``(n,) int32`` labels.

    With ``crop < 1`` (evaluation) each image is decoded at ``size / crop`` and its centre kept
    (`augment.center_crop`): torchvision's Resize + CenterCrop, one resampling.
    """
    import augment
    outer, i = max(chunk.size, int(round(chunk.size / chunk.crop))), 0
    try:
        images = np.empty((chunk.n, 3, outer, outer), np.uint8)
        for i, f in enumerate(chunk.files):
            images[i] = decode_file(f, outer, chunk.max_pixels)
    except MemoryError:  # one line naming what sizes it, not a worker traceback
        raise DataError(f"out of memory decoding {chunk.n} images at {outer}x{outer} (at "
                        f"{chunk.files[min(i, chunk.n - 1)].path if chunk.n else '-'}): lower "
                        "--image-size, data.decode_chunk or data.max_pixels") from None
    if outer != chunk.size:
        images = np.ascontiguousarray(augment.center_crop(images, chunk.size))
    return images, np.array([f.label for f in chunk.files], np.int32).reshape(-1)


# --------------------------------------------------------------------------------------------
# Reports


def first_problems(files: tuple, infos: tuple) -> str | None:
    """One line for the first bad file (and how many more there are), or None if all are good."""
    bad = [info.error for info in infos if info.error]
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more bad file{'s' if len(bad) > 2 else ''})" if len(bad) > 1 \
        else ""
    return bad[0] + more


def class_counts(listing: Listing) -> dict:
    """{class name: images} of a split."""
    counts = np.bincount([f.label for f in listing.files], minlength=len(listing.class_names))
    return {name: int(c) for name, c in zip(listing.class_names, counts)}


def summary(infos: tuple) -> dict:
    """Image sizes seen, formats and modes of scanned files, for ``inspect`` (plain ints, strs)."""
    widths = [i.width for i in infos]
    heights = [i.height for i in infos]
    sizes = Counter(f"{i.width}x{i.height}" for i in infos)
    return {
        "formats": dict(Counter(i.format for i in infos).most_common()),
        "modes": dict(Counter(i.mode for i in infos).most_common()),
        "sizes_seen": dict(sizes.most_common(10)),
        "distinct_sizes": len(sizes),
        "width_range": [min(widths), max(widths)] if widths else [],
        "height_range": [min(heights), max(heights)] if heights else [],
    }
