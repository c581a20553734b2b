"""Preview figures: a labelled grid and originals vs augmented rows, rendered without pyplot (Agg-safe)."""
from __future__ import annotations

import io

import numpy as np
import pytest
from matplotlib.figure import Figure

import augment
from pipeline.outputs.preview import augmentation_preview, image_grid


@pytest.fixture
def images() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (12, 3, 32, 32), dtype=np.uint8)


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def test_grid_layout_titles_and_png(images):
    names = [f"class{i}" for i in range(10)]
    fig = image_grid(images, np.arange(12) % 10, names, ncols=5)
    assert isinstance(fig, Figure) and len(fig.axes) == 15  # 3 rows x 5, the last 3 empty
    assert [ax.get_title() for ax in fig.axes[:3]] == ["class0", "class1", "class2"]
    assert sum(bool(ax.images) for ax in fig.axes) == 12
    np.testing.assert_array_equal(fig.axes[1].images[0].get_array(),
                                  images[1].transpose(1, 2, 0))
    assert _png(fig).startswith(b"\x89PNG")


def test_grid_without_labels_and_single_channel():
    fig = image_grid(np.zeros((3, 1, 8, 8), np.uint8))
    assert len(fig.axes) == 3 and all(ax.get_title() == "" for ax in fig.axes)
    assert fig.axes[0].images[0].get_array().shape == (8, 8)


def test_preview_rows_are_original_then_augmented(images):
    policy = augment.get_policy("cifar")
    fig = augmentation_preview(images, policy, seed=3, n=4, rows=2)
    assert len(fig.axes) == 12
    shown = [np.asarray(ax.images[0].get_array()) for ax in fig.axes]
    for i in range(4):
        np.testing.assert_array_equal(shown[i], images[i].transpose(1, 2, 0))
    row1 = policy(images[:4], np.random.default_rng([3, 0]))
    np.testing.assert_array_equal(shown[4], row1[0].transpose(1, 2, 0))
    assert repr(policy) in fig.get_suptitle()
    again = augmentation_preview(images, policy, seed=3, n=4, rows=2)
    assert all(np.array_equal(a.images[0].get_array(), b.images[0].get_array())
               for a, b in zip(fig.axes, again.axes))
    assert _png(fig).startswith(b"\x89PNG")


def test_preview_and_grid_validate_inputs(images):
    with pytest.raises(ValueError, match="images must be a uint8 array"):
        image_grid(images.astype(np.float32))
    with pytest.raises(ValueError, match="ncols must be >= 1"):
        image_grid(images, ncols=0)
    with pytest.raises(ValueError, match="preview needs n >= 1 images"):
        augmentation_preview(images[:0], augment.get_policy("flip"))


def test_no_pyplot_state_is_created(images):
    import sys
    image_grid(images)
    augmentation_preview(images, augment.get_policy("cifar-cutout"))
    if "matplotlib.pyplot" in sys.modules:
        import matplotlib.pyplot as plt
        assert plt.get_fignums() == []
