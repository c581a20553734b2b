"""CuPy gives the same bytes as NumPy for every op and policy (skipped without a CUDA device)."""
from __future__ import annotations

import numpy as np
import pytest

import augment
from augment import ops
from tests.augment.conftest import ALL_OPS
from tests.gpu_guard import require_cuda

require_cuda()

import cupy  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def pair(images):
    return images, cupy.asarray(images)


@pytest.mark.parametrize("mode", ops.MODES)
def test_shift_flip_same_bytes(pair, mode):
    host, dev = pair
    rng = np.random.default_rng(0)
    sy, sx = rng.integers(-4, 5, len(host)), rng.integers(-4, 5, len(host))
    mask = rng.random(len(host)) < 0.5
    out = ops.shift_flip(dev, sy, sx, mask, mode)
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(out), ops.shift_flip(host, sy, sx, mask, mode))


@pytest.mark.parametrize("policy", list(augment.POLICIES.values()) + [ALL_OPS], ids=repr)
def test_policies_same_bytes(pair, policy):
    host, dev = pair
    params = policy.sample(np.random.default_rng(1), len(host))
    np.testing.assert_array_equal(cupy.asnumpy(policy.apply(dev, params)), policy.apply(host, params))


def test_normalize_and_tta_same_values(pair):
    host, dev = pair
    np.testing.assert_array_equal(cupy.asnumpy(ops.normalize(dev)), ops.normalize(host))
    for a, b in zip(augment.tta_views(dev), augment.tta_views(host)):
        np.testing.assert_array_equal(cupy.asnumpy(a), b)
