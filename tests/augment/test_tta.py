"""Test-time augmentation: the views are deterministic and the average is the mean of the views' probabilities."""
from __future__ import annotations

import numpy as np
import pytest

from augment import flip, translate, tta_average, tta_views


def test_views_are_identity_flip_and_shifted_crops(images):
    views = tta_views(images)
    n = len(images)
    np.testing.assert_array_equal(views[0], images)
    np.testing.assert_array_equal(views[1], images[..., ::-1])
    np.testing.assert_array_equal(views[2], translate(images, np.full(n, 2), np.full(n, 2)))
    np.testing.assert_array_equal(views[3], flip(views[2], np.ones(n, bool)))
    assert len(views) == 6 and all(v.dtype == np.uint8 and v.shape == images.shape for v in views)
    for a, b in zip(views, tta_views(images)):
        np.testing.assert_array_equal(a, b)


def _softmax_model(images):
    """A fixed "model": softmax of per-channel means, so every view gives different probabilities."""
    logits = images.reshape(len(images), images.shape[1], -1).mean(axis=2) / 50.0
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def test_average_is_mean_of_view_probabilities(images):
    expected = np.mean([_softmax_model(v).astype(np.float64) for v in tta_views(images)], axis=0)
    out = tta_average(_softmax_model, images)
    assert out.dtype == np.float32 and out.shape == (len(images), 3)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=1e-5)


def test_average_checks_prediction_shape(images):
    with pytest.raises(ValueError, match=r"predict_proba must return \(N, K\) = \(37, K\)"):
        tta_average(lambda v: np.zeros(len(v)), images)


def test_custom_shifts():
    x = np.zeros((2, 1, 4, 4), np.uint8)
    assert len(tta_views(x, shifts=())) == 2 and len(tta_views(x, shifts=((1, 0),))) == 4
