"""Fixtures and strategies for the augment tests: small seeded uint8 batches and per-image NumPy oracles."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.extra import numpy as hnp

from augment import BrightnessContrast, Compose, Cutout, Flip, PadCrop, Translate

settings.register_profile("augment", max_examples=100, deadline=None, derandomize=True,
                          database=None)  # same examples every run, nothing replayed from disk
AUGMENT = settings.get_profile("augment")
# A policy with every op, the fused paths included.
ALL_OPS = Compose([Translate(3), Flip(0.3), PadCrop(2, "reflect"), Flip(), Cutout(5),
                   BrightnessContrast(0.3, 0.4)])


@pytest.fixture
def images() -> np.ndarray:
    """(37, 3, 32, 32) uint8, seeded: CIFAR-shaped, an odd count so groups are uneven."""
    return np.random.default_rng(1234).integers(0, 256, (37, 3, 32, 32), dtype=np.uint8)


def batches(max_n: int = 6, max_side: int = 9, min_side: int = 1):
    """Hypothesis strategy: (N, C, H, W) uint8 arrays, N may be 0."""
    shape = st.tuples(st.integers(0, max_n), st.integers(1, 3), st.integers(min_side, max_side),
                      st.integers(min_side, max_side))
    return shape.flatmap(lambda s: hnp.arrays(np.uint8, s, elements=st.integers(0, 255)))


def ref_shift_flip(img: np.ndarray, sy: int, sx: int, flip: bool, mode: str) -> np.ndarray:
    """Per-image oracle: pad with np.pad by the shift, slice the window, mirror. (C, H, W) -> same."""
    _, h, w = img.shape
    py, px = abs(sy), abs(sx)
    padded = np.pad(img, ((0, 0), (py, py), (px, px)), "constant" if mode == "zero" else "reflect")
    out = padded[:, py + sy:py + sy + h, px + sx:px + sx + w]
    return out[:, :, ::-1] if flip else out


def ref_batch(images, sy, sx, flip, mode) -> np.ndarray:
    """`ref_shift_flip` over a batch (the per-image loop the kernels replace)."""
    out = np.empty_like(images)
    for i in range(len(images)):
        out[i] = ref_shift_flip(images[i], int(sy[i]), int(sx[i]), bool(flip[i]), mode)
    return out
