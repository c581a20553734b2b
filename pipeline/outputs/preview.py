"""Notebook-friendly matplotlib figures of image batches: a labelled grid, and originals vs augmented views.

Figures are built with ``matplotlib.figure.Figure`` directly (no pyplot state, any backend):
show them in a notebook by returning them from a cell, or ``fig.savefig("grid.png")``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

import augment
from augment.xp import to_host

CELL_INCHES = 1.0  # figure inches per image cell


def _hwc(image: np.ndarray) -> np.ndarray:
    """(C, H, W) uint8 -> (H, W, C) for imshow, or (H, W) for one channel."""
    return image[0] if image.shape[0] == 1 else np.transpose(image, (1, 2, 0))


def _label(labels, label_names, i: int) -> str | None:
    if labels is None:
        return None
    label = int(labels[i])
    return str(label_names[label]) if label_names is not None else str(label)


def image_grid(images, labels=None, label_names: Sequence[str] | None = None,
               ncols: int = 10) -> Figure:
    """A grid of images, ``ncols`` per row, each titled with its label (name) when given.

    images: (N, C, H, W) uint8 (NumPy or CuPy); labels: (N,) ints or None;
    label_names: class names indexed by label.

    >>> fig = image_grid(np.zeros((3, 3, 8, 8), np.uint8), [0, 1, 2], ["a", "b", "c"], ncols=2)
    >>> len(fig.axes), fig.axes[1].get_title()
    (4, 'b')
    """
    images = to_host(images)
    augment.check_images(images)
    if ncols < 1:
        raise ValueError(f"ncols must be >= 1, got {ncols}")
    n = len(images)
    ncols = min(ncols, max(n, 1))
    nrows = max(1, math.ceil(n / ncols))
    fig = Figure(figsize=(ncols * CELL_INCHES, nrows * CELL_INCHES * 1.2), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).reshape(-1)
    for i, ax in enumerate(axes):
        ax.set_axis_off()
        if i < n:
            ax.imshow(_hwc(images[i]), cmap="gray", vmin=0, vmax=255, interpolation="nearest")
            title = _label(labels, label_names, i)
            if title is not None:
                ax.set_title(title, fontsize=7)
    return fig


def augmentation_preview(images, policy: augment.Compose, seed: int = 0, n: int = 8,
                         rows: int = 3) -> Figure:
    """The first ``n`` images (top row, "original") above ``rows`` independently augmented copies.

    Row r is ``policy(images[:n], numpy.random.default_rng([seed, r]))``: the preview is the same
    for the same seed. images: (N, C, H, W) uint8.

    >>> fig = augmentation_preview(np.zeros((4, 3, 8, 8), np.uint8), augment.get_policy("cifar"))
    >>> len(fig.axes)
    16
    """
    images = to_host(images)[:n]
    augment.check_images(images)
    if len(images) == 0 or rows < 0:
        raise ValueError(f"preview needs n >= 1 images and rows >= 0, got {len(images)} and {rows}")
    batches = [images] + [policy(images, np.random.default_rng([seed, r])) for r in range(rows)]
    per_row = len(images)
    fig = image_grid(np.concatenate(batches), ncols=per_row)
    for r in range(rows + 1):
        label = "original" if r == 0 else f"augmented {r}"
        fig.axes[r * per_row].text(-0.1, 0.5, label, rotation=90, fontsize=7, ha="right",
                                   va="center", transform=fig.axes[r * per_row].transAxes)
    fig.suptitle(repr(policy), fontsize=8)
    return fig
