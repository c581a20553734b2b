"""Test-time augmentation: a fixed set of views of a batch and the mean of a model's probabilities over them."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from augment import ops
from augment.xp import array_module

# (ty, tx) translations (pixels, zero fill) added to the identity; each is also used flipped.
TTA_SHIFTS = ((2, 2), (-2, -2))


def tta_views(images, shifts=TTA_SHIFTS) -> list:
    """Deterministic views: identity, flip, then each shift and its flip. (N, C, H, W) uint8 -> list.

    >>> len(tta_views(np.zeros((2, 3, 8, 8), np.uint8)))
    6
    """
    ops.check_images(images)
    n = len(images)
    views = [images, ops.flip(images, np.ones(n, bool))]
    for ty, tx in shifts:
        moved = ops.translate(images, np.full(n, ty), np.full(n, tx))
        views += [moved, ops.flip(moved, np.ones(n, bool))]
    return views


def tta_average(predict_proba: Callable, images, shifts=TTA_SHIFTS):
    """Mean of ``predict_proba(view)`` over `tta_views`: (N, C, H, W) uint8 -> (N, K) float32.

    ``predict_proba`` maps a uint8 batch to (N, K) class probabilities (softmax already applied).
    Sums in float64 and divides once; the result has the array module of the predictions.

    >>> tta_average(lambda v: np.full((len(v), 2), 0.5), np.zeros((3, 1, 4, 4), np.uint8)).tolist()
    [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]
    """
    total = None
    views = tta_views(images, shifts)
    for view in views:
        proba = predict_proba(view)
        if proba.ndim != 2 or proba.shape[0] != len(images):
            raise ValueError(f"predict_proba must return (N, K) = ({len(images)}, K) "
                             f"probabilities, got shape {tuple(proba.shape)}")
        proba = proba.astype(array_module(proba).float64)
        total = proba if total is None else total + proba
    return (total / len(views)).astype(np.float32)
