"""The synthetic CIFAR-10: labelled shapes drawn from the data seed, in memory or as files."""
from __future__ import annotations

import numpy as np

from pipeline.core.rng import rng_for
from pipeline.data.cifar.layout import (CIFAR10_LABEL_NAMES, MAX_IMAGES_PER_FILE, SPLITS,
                                        TRAIN_BATCHES)
from pipeline.data.cifar.write import write_binary10, write_python10


def split_sizes(n: int, parts: int) -> list[int]:
    """n items over ``parts`` chunks as equal as possible, larger first (like np.array_split).

    >>> split_sizes(11, 5)
    [3, 2, 2, 2, 2]
    """
    return [n // parts + (i < n % parts) for i in range(parts)]


# Class c draws shape c % 5 in colour family c // 5: neither shape nor colour alone tells the
# class, and colour jitter, a random background, placement, size and noise keep it from being
# trivially separable (a small CNN gets well above chance in an epoch on 5,000 images).
def _disk(dy, dx, r):
    """Offsets ``(k, 32, 32)`` from each image's centre and radii ``(k, 1, 1)`` -> mask."""
    return dy * dy + dx * dx <= r * r


def _square(dy, dx, r):
    return np.maximum(np.abs(dy), np.abs(dx)) <= 0.8 * r


def _ring(dy, dx, r):
    dist2 = dy * dy + dx * dx
    return (dist2 <= r * r) & (dist2 >= (0.55 * r) ** 2)


def _stripes(dy, dx, r):  # horizontal bars 2 px wide inside the square
    return (np.maximum(np.abs(dy), np.abs(dx)) <= r) & (np.floor(dy / 2) % 2 == 0)


def _cross(dy, dx, r):
    return (np.maximum(np.abs(dy), np.abs(dx)) <= r) & ((np.abs(dy) <= r / 3) |
                                                        (np.abs(dx) <= r / 3))


_SHAPES = (_disk, _square, _ring, _stripes, _cross)
_FAMILIES = np.array([[200, 90, 60], [60, 110, 200]], np.float32)  # warm / cool mean RGB
_YY, _XX = np.mgrid[0:32, 0:32].astype(np.float32)


def synthetic_labels(seed: int, split: str, index: int, n: int) -> np.ndarray:
    """Labels of synthetic chunk ``index`` of ``split``: ``(n,) int32``, balanced over 10 classes.

    The first draw of the chunk's generator, so they equal ``synthetic_batch(...)[1]``.

    >>> synthetic_labels(0, "train", 0, 20).tolist().count(3)
    2
    """
    rng = rng_for(seed, "synthetic", SPLITS[split], index)
    return rng.permutation(np.arange(n) % 10).astype(np.int32)


def synthetic_batch(seed: int, split: str, index: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk ``index`` of ``split`` of the synthetic dataset.

    Returns images ``(n, 3, 32, 32) uint8`` and labels ``(n,) int32``. Pure: the same arguments
    give the same bytes on any worker (the generator is ``rng_for(seed, "synthetic", split,
    index)``).

    >>> a, la = synthetic_batch(0, "test", 0, 8)
    >>> b, lb = synthetic_batch(0, "test", 0, 8)
    >>> bool((a == b).all() and (la == lb).all()), a.shape
    (True, (8, 3, 32, 32))
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {tuple(SPLITS)}, got {split!r}")
    rng = rng_for(seed, "synthetic", SPLITS[split], index)
    labels = rng.permutation(np.arange(n) % 10).astype(np.int32)
    return render(labels, rng), labels


def render(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Class ids ``(n,) int`` -> images ``(n, 3, 32, 32) uint8`` drawn with ``rng``."""
    n = len(labels)
    background = rng.uniform(0, 255, (n, 3)).astype(np.float32)
    foreground = _FAMILIES[labels // 5] + rng.normal(0, 45, (n, 3)).astype(np.float32)
    centre = rng.uniform(9, 23, (n, 2)).astype(np.float32)
    radius = rng.uniform(5, 11, n).astype(np.float32)
    mask = np.empty((n, 1, 32, 32), bool)
    for shape, draw in enumerate(_SHAPES):  # loop over the five shapes, never over images
        picked = np.flatnonzero(labels % 5 == shape)
        mask[picked, 0] = draw(_YY - centre[picked, 0, None, None],
                               _XX - centre[picked, 1, None, None], radius[picked, None, None])
    images = np.where(mask, foreground[:, :, None, None], background[:, :, None, None])
    images += rng.normal(0, 24, images.shape).astype(np.float32)
    return np.clip(images, 0, 255).round().astype(np.uint8)


def _synthetic_batches(n_train: int, n_test: int, seed: int):
    train = [synthetic_batch(seed, "train", i, n)
             for i, n in enumerate(split_sizes(n_train, TRAIN_BATCHES))]
    return train, synthetic_batch(seed, "test", 0, n_test)


def write_synthetic(out: str, n_train: int = 5000, n_test: int = 1000, seed: int = 0,
                    tar: bool = False, fmt: str = "python") -> str:
    """Write a synthetic CIFAR-10 in an official format under ``out``; return the ``--data`` path.

    ``fmt="python"`` writes ``out/cifar-10-batches-py/`` (five training batches, as equal as
    possible, plus ``test_batch``, ``batches.meta`` and ``readme.html``), byte-compatible with the
    official pickles; ``fmt="binary"`` writes ``out/cifar-10-batches-bin/``. With ``tar=True`` also
    the official archive (``cifar-10-python.tar.gz`` / ``cifar-10-binary.tar.gz``) beside it. The
    content equals the on-the-fly ``synthetic:n_train:n_test`` source of the same seed.
    """
    if n_train < TRAIN_BATCHES:
        raise ValueError(f"n_train must be >= {TRAIN_BATCHES} (one image per batch file), "
                         f"got {n_train}")
    if n_train > TRAIN_BATCHES * MAX_IMAGES_PER_FILE:
        raise ValueError(f"n_train must be <= {TRAIN_BATCHES * MAX_IMAGES_PER_FILE} (five "
                         f"files of at most {MAX_IMAGES_PER_FILE} images), got {n_train}")
    if n_test < 1:
        raise ValueError(f"n_test must be >= 1, got {n_test}")
    if n_test > MAX_IMAGES_PER_FILE:
        raise ValueError(f"n_test must be <= {MAX_IMAGES_PER_FILE} (one file), got {n_test}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if fmt not in ("python", "binary"):
        raise ValueError(f"fmt must be python or binary, got {fmt!r}")
    train, test = _synthetic_batches(n_train, n_test, seed)
    writer = write_python10 if fmt == "python" else write_binary10
    return writer(out, train, test, CIFAR10_LABEL_NAMES, tar=tar)
