"""The checks of data given as arrays (``pipeline.data.arrays``): every block against what its
Dask array declares, labels and class counts, image shapes, and every size bounded by what the
input justifies before anything is allocated by it. NumPy only."""
from __future__ import annotations

import numpy as np

from pipeline.core.config_data import MAX_CLASSES, MAX_IMAGE_SIZE
from pipeline.core.errors import DataError
from pipeline.core.rng import rng_for
from pipeline.data.readers import check_class_names


def check_block(block, name: str, block_info=None):
    """The ``check_block-`` task: ``block`` as it is, or DataError when its shape or dtype is not
    the one its Dask array declares (a ``map_blocks`` or ``from_delayed`` given the wrong
    ``chunks``, ``shape`` or ``dtype``): training would read the wrong rows silently.

    >>> info = {None: {"chunk-shape": (2, 3), "chunk-location": (1, 0), "dtype": np.uint8}}
    >>> check_block(np.zeros((2, 3), np.uint8), "x_train", info).shape
    (2, 3)
    >>> check_block(np.zeros((5, 3), np.uint8), "x_train", info)
    Traceback (most recent call last):
    ...
    pipeline.core.errors.DataError: x_train: block (1, 0) holds a (5, 3) uint8 array, its Dask array declares (2, 3) uint8: the chunks, shape and dtype given to map_blocks / from_delayed must be the blocks' own
    """
    if block_info is None:  # dask's meta call
        return block
    info = block_info[None]
    declared, dtype = tuple(info["chunk-shape"]), np.dtype(info["dtype"])
    shape, got = tuple(getattr(block, "shape", ())), getattr(block, "dtype", None)
    if shape != declared or got != dtype:
        raise DataError(f"{name}: block {tuple(info['chunk-location'])} holds a {shape} {got} "
                        f"array, its Dask array declares {declared} {dtype}: the chunks, "
                        "shape and dtype given to map_blocks / from_delayed must be the "
                        "blocks' own")
    return block


def labels_arrived(y, n: int, name: str) -> None:
    """DataError unless the computed labels ``y`` (None: none given) are the ``(n,)`` integers
    their array declared (a Dask array's blocks may hold other shapes or dtypes)."""
    if y is not None and (y.shape != (n,) or y.dtype.kind not in "iu"):
        raise DataError(f"{name}: its blocks hold a {y.shape} {y.dtype} array, its Dask array "
                        f"declares ({n},) integer labels")


def check_length(n: int, first_image, name: str, available: int) -> None:
    """DataError unless ``n`` examples shaped like ``first_image`` fit in ``available`` bytes
    (a dataset's ``len`` taken on trust would size one array of all of them).

    >>> check_length(10 ** 12, np.zeros((3, 8, 8), np.float32), "x_train", 1 << 30)
    Traceback (most recent call last):
    ...
    pipeline.core.errors.DataError: x_train: the dataset's len is 1000000000000 examples of (3, 8, 8) float32, 698.5 TiB: more than this machine's 1.0 GiB of available memory (give data that large as a Dask array: pipeline.data.arrays.from_store)
    """
    need = n * np.asarray(first_image).nbytes
    if need > available:
        raise DataError(f"{name}: the dataset's len is {n} examples of {np.shape(first_image)} "
                        f"{np.asarray(first_image).dtype}, {fmt_bytes(need)}: more than this "
                        f"machine's {fmt_bytes(available)} of available memory (give data that "
                        "large as a Dask array: pipeline.data.arrays.from_store)")


def check_labels(y: np.ndarray, yt, n_classes) -> int:
    """The class count; DataError for a label out of range, a class count past
    ``MAX_CLASSES`` or (without ``n_classes``) a class with no training image. No array is
    sized by a label before it is checked."""
    for name, v in (("y_train", y), ("y_test", yt)):
        if v is not None and len(v) and v.min() < 0:
            raise DataError(f"{name}: label {int(v.min())} at row {int(np.argmin(v))} is "
                            "negative (labels are 0..K-1)")
    if n_classes is None:
        n = int(y.max()) + 1 if len(y) else 0
        if n > min(len(y), MAX_CLASSES):  # every class has an image: at most len(y) classes
            raise DataError(f"y_train: label {n - 1} at row {int(np.argmax(y))} is out of "
                            f"range: {len(y)} images with every class present hold labels "
                            f"0..{min(len(y), MAX_CLASSES) - 1} at most (give n_classes when "
                            "some classes have no image)")
        empty = np.flatnonzero(np.bincount(y.astype(np.int64), minlength=n) == 0)
        if n < 2:
            raise DataError(f"y_train: at least 2 classes needed, found {n}")
        if len(empty):
            raise DataError(f"y_train: labels 0..{n - 1} with no image for class "
                            f"{int(empty[0])} ({len(empty)} empty in all); give n_classes "
                            "when some classes have no training image")
        n_classes = n
    if isinstance(n_classes, bool) or not isinstance(n_classes, (int, np.integer)):
        raise DataError(f"n_classes: {n_classes!r:.40}; expected an integer")
    if not 2 <= n_classes <= MAX_CLASSES:
        raise DataError(f"n_classes: {n_classes}; at least 2 classes needed" if n_classes < 2
                        else f"n_classes: {n_classes}; at most {MAX_CLASSES} classes "
                        "(model.n_classes' limit)")
    for name, v in (("y_train", y), ("y_test", yt)):
        if v is not None and len(v) and v.max() >= n_classes:
            raise DataError(f"{name}: label {int(v.max())} at row {int(np.argmax(v))} is out of "
                            f"range (labels are 0..{n_classes - 1})")
    return int(n_classes)


def check_shape(x, xt, cfg) -> None:
    """Both splits hold images of one square size within ``MAX_IMAGE_SIZE`` and
    ``data.image_size`` (``x``, ``xt``: ``(N, 3, H, W)`` arrays)."""
    if x.shape[0] == 0 or xt.shape[0] == 0:
        raise DataError(f"data: {'x_train' if x.shape[0] == 0 else 'x_test'} holds no image")
    if xt.shape[1:] != x.shape[1:]:
        raise DataError(f"x_test: images are {shape_text(xt)}, x_train's {shape_text(x)}: one "
                        "image size for both splits")
    if x.shape[2] != x.shape[3]:
        raise DataError(f"x_train: images are {shape_text(x)}; square images expected (H == W)")
    if x.shape[2] > MAX_IMAGE_SIZE:
        raise DataError(f"x_train: images are {shape_text(x)}; at most {MAX_IMAGE_SIZE} pixels "
                        "a side (data.image_size's limit; resize them)")
    if cfg.image_size not in (None, x.shape[2]):
        raise DataError(f"data.image_size {cfg.image_size}: the arrays' images are "
                        f"{shape_text(x)} (resize them, or leave image_size unset)")


def shape_text(a) -> str:
    return "x".join(str(d) for d in a.shape[1:])


def names(given, n_classes: int) -> tuple:
    """Class index -> name: ``given`` checked (one per class, ``readers.check_class_names``),
    or ``"0"``, ``"1"``, ..."""
    if given is None:
        return tuple(str(i) for i in range(n_classes))
    if isinstance(given, (str, bytes)) or not hasattr(given, "__len__"):
        raise DataError(f"label_names: a {type(given).__name__}, expected a list of names")
    if len(given) != n_classes:
        raise DataError(f"label_names: {len(given)} names for {n_classes} classes")
    return check_class_names(tuple(str(n) for n in given), "label_names")


def held_out(x, y: np.ndarray, cfg):
    """The seeded stratified split of image folders (``data.val_fraction``, ``split_seed``)."""
    to_val = np.zeros(len(y), bool)
    rng = rng_for(cfg.split_seed, "split")
    for label in range(int(y.max()) + 1):
        members = np.flatnonzero(y == label)
        k = int(round(cfg.val_fraction * len(members)))
        k = min(max(k, 1 if len(members) > 1 else 0), max(len(members) - 1, 0))
        to_val[rng.permutation(members)[:k]] = True
    keep, val = np.flatnonzero(~to_val), np.flatnonzero(to_val)
    return x[keep], y[keep], x[val], y[val]


def nbytes(a) -> int:
    return int(np.prod(a.shape)) * a.dtype.itemsize


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
