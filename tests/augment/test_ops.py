"""Kernels in augment.ops against per-image NumPy oracles, plus invariants (flip twice, pad 0, ...)."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, strategies as st

import augment
from augment import ops
from tests.augment.conftest import AUGMENT, batches, ref_batch, ref_shift_flip


def _shifts(draw, n, limit):
    ints = st.lists(st.integers(-limit, limit), min_size=n, max_size=n)
    flips = st.lists(st.booleans(), min_size=n, max_size=n)
    return np.array(draw(ints), np.int64), np.array(draw(ints), np.int64), np.array(draw(flips), bool)


@AUGMENT
@given(batches(), st.data())
def test_shift_flip_zero_matches_oracle(images, data):
    sy, sx, flip = _shifts(data.draw, len(images), 11)  # beyond the 9-px images: all zeros
    out = ops.shift_flip(images, sy, sx, flip, "zero")
    assert out.dtype == np.uint8 and out.shape == images.shape
    np.testing.assert_array_equal(out, ref_batch(images, sy, sx, flip, "zero"))


@AUGMENT
@given(batches(min_side=5), st.data())
def test_shift_flip_reflect_matches_oracle(images, data):
    sy, sx, flip = _shifts(data.draw, len(images), 4)
    out = ops.shift_flip(images, sy, sx, flip, "reflect")
    np.testing.assert_array_equal(out, ref_batch(images, sy, sx, flip, "reflect"))


@pytest.mark.parametrize("mode", ops.MODES)
def test_fast_numpy_path_equals_gather_path(images, mode):
    # The gather is what CuPy runs: equal here means CPU and GPU agree to the byte.
    rng = np.random.default_rng(5)
    sy, sx = rng.integers(-4, 5, len(images)), rng.integers(-4, 5, len(images))
    flip = rng.random(len(images)) < 0.5
    np.testing.assert_array_equal(ops.shift_flip(images, sy, sx, flip, mode),
                                  ops.shift_flip_gather(images, sy, sx, flip, mode))


@pytest.mark.parametrize("shape", [(700, 1, 5, 8), (600, 3, 7, 9), (300, 2, 3, 16)])
def test_fast_path_across_blocks_and_row_widths(shape):
    # Several BLOCKs; widths that do (8, 16) and do not (9) take the u64 flip.
    assert shape[0] > ops.BLOCK
    rng = np.random.default_rng(shape[0])
    x = rng.integers(0, 256, shape, dtype=np.uint8)
    sy, sx = rng.integers(-5, 6, shape[0]), rng.integers(-9, 10, shape[0])
    flip = rng.random(shape[0]) < 0.5
    np.testing.assert_array_equal(ops.shift_flip(x, sy, sx, flip),
                                  ops.shift_flip_gather(x, sy, sx, flip, "zero"))


def test_cifar_pad_crop_flip_matches_per_image_loop(images):
    rng = np.random.default_rng(6)
    dy, dx = rng.integers(0, 9, len(images)), rng.integers(0, 9, len(images))
    mask = rng.random(len(images)) < 0.5
    expected = np.stack([
        (lambda c: c[:, :, ::-1] if m else c)(np.pad(img, ((0, 0), (4, 4), (4, 4)))[:, y:y + 32, x:x + 32])
        for img, y, x, m in zip(images, dy, dx, mask)])
    np.testing.assert_array_equal(ops.pad_crop_flip(images, dy, dx, mask, 4), expected)
    np.testing.assert_array_equal(ops.flip(ops.pad_crop(images, dy, dx, 4), mask), expected)


@AUGMENT
@given(batches())
def test_flip_twice_is_identity(images):
    mask = np.arange(len(images)) % 2 == 0
    once = ops.flip(images, mask)
    np.testing.assert_array_equal(ops.flip(once, mask), images)
    np.testing.assert_array_equal(once[~mask], images[~mask])


@AUGMENT
@given(batches(), st.sampled_from(ops.MODES), st.integers(0, 3))
def test_pad_crop_centre_and_pad_zero_are_identity(images, mode, pad):
    n = len(images)
    if mode == "reflect" and pad >= min(images.shape[2:]):
        pad = 0
    centre = np.full(n, pad)
    np.testing.assert_array_equal(ops.pad_crop(images, centre, centre, pad, mode), images)
    np.testing.assert_array_equal(ops.pad_crop(images, np.zeros(n, int), np.zeros(n, int), 0, mode),
                                  images)


@AUGMENT
@given(batches(), st.data())
def test_translate_back_keeps_the_overlap(images, data):
    n, _, h, w = images.shape
    ty, tx, _ = _shifts(data.draw, n, 3)
    back = ops.translate(ops.translate(images, ty, tx), -ty, -tx)
    for i in range(n):
        rows = (np.arange(h) + ty[i] >= 0) & (np.arange(h) + ty[i] < h)  # survived the round trip
        cols = (np.arange(w) + tx[i] >= 0) & (np.arange(w) + tx[i] < w)
        keep = rows[:, None] & cols[None, :]
        np.testing.assert_array_equal(back[i], images[i] * keep)


def test_translate_moves_content_down_right():
    x = np.zeros((1, 1, 4, 4), np.uint8)
    x[0, 0, 0, 0] = 7
    assert ops.translate(x, [2], [1])[0, 0, 2, 1] == 7


def test_non_contiguous_and_empty_inputs(images):
    view = images[::2, :, :, ::-1]
    sy = np.arange(len(view)) % 5 - 2
    np.testing.assert_array_equal(ops.shift_flip(view, sy, -sy), ref_batch(view, sy, -sy,
                                  np.zeros(len(view), bool), "zero"))
    empty = images[:0]
    for out in (ops.pad_crop(empty, [], [], 4), ops.cutout(empty, [], [], 3),
                ops.brightness_contrast(empty, [], [])):
        assert out.shape == empty.shape and out.dtype == np.uint8
    assert ops.normalize(empty).shape == empty.shape


@AUGMENT
@given(batches(), st.data(), st.integers(0, 10))
def test_cutout_zeroes_only_the_clipped_square(images, data, size):
    n, _, h, w = images.shape
    cy = np.array(data.draw(st.lists(st.integers(0, h - 1), min_size=n, max_size=n)), np.int64)
    cx = np.array(data.draw(st.lists(st.integers(0, w - 1), min_size=n, max_size=n)), np.int64)
    out = ops.cutout(images, cy, cx, size)
    for i in range(n):
        y0, x0 = cy[i] - size // 2, cx[i] - size // 2
        expected = images[i].copy()
        expected[:, max(0, y0):max(0, y0 + size), max(0, x0):max(0, x0 + size)] = 0
        np.testing.assert_array_equal(out[i], expected)


@AUGMENT
@given(batches(), st.data())
def test_brightness_contrast_close_to_float_oracle(images, data):
    n = len(images)
    factors = st.lists(st.floats(0.5, 1.5), min_size=n, max_size=n)
    b, c = np.array(data.draw(factors)), np.array(data.draw(factors))
    out = ops.brightness_contrast(images, b, c)
    assert out.dtype == np.uint8 and out.shape == images.shape
    bq, cq = np.rint(b * 256) / 256, np.rint(c * 256) / 256  # the kernel's 1/256 quantization
    x = images.astype(np.float64)
    m = x.reshape(n, -1).mean(axis=1).reshape(n, 1, 1, 1) if n else 0
    ref = np.clip(bq.reshape(-1, 1, 1, 1) * (cq.reshape(-1, 1, 1, 1) * (x - m) + m), 0, 255)
    assert np.abs(out.astype(np.float64) - ref).max(initial=0) <= 1.0


@AUGMENT
@given(batches())
def test_brightness_contrast_unit_factors_are_identity(images):
    ones = np.ones(len(images))
    np.testing.assert_array_equal(ops.brightness_contrast(images, ones, ones), images)


def test_normalize_matches_float64(images):
    out = ops.normalize(images)
    mean = np.array(ops.CIFAR10_MEAN).reshape(1, 3, 1, 1)
    std = np.array(ops.CIFAR10_STD).reshape(1, 3, 1, 1)
    assert out.dtype == np.float32 and out.shape == images.shape
    np.testing.assert_allclose(out, (images - mean) / std, rtol=1e-6, atol=1e-6)


def test_cifar10_constants_are_in_uint8_units():
    assert all(100 < m < 130 for m in ops.CIFAR10_MEAN)
    assert all(60 < s < 70 for s in ops.CIFAR10_STD)


@pytest.mark.parametrize("call, message", [
    (lambda x: ops.flip(x.astype(np.float32), [True]), "images must be a uint8 array"),
    (lambda x: ops.flip(x, [True, False]), r"flip must have shape \(1,\)"),
    (lambda x: ops.shift_flip(x, [0], [0], None, "wrap"), "mode must be one of"),
    (lambda x: ops.shift_flip(x, [4], [0], None, "reflect"), "reflect shifts must be smaller"),
    (lambda x: ops.pad_crop(x, [9], [0], 4), r"must be in \[0, 8\]"),
    (lambda x: ops.normalize(x, [1.0], [1.0, 1.0]), "one value per channel"),
    (lambda x: ops.normalize(x, [0, 0, 0], [1, 0, 1]), "std must be > 0"),
    (lambda x: ops.brightness_contrast(x, [2.5], [1.0]), r"factors must be in \[0, 2\)"),
    (lambda x: ops.cutout(x, [0], [0], -1), "cutout size must be >= 0"),
])
def test_errors_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call(np.zeros((1, 3, 4, 4), np.uint8))


@pytest.mark.parametrize("fn", [ops.shift_flip, ops.pad_crop, ops.pad_crop_flip, ops.flip,
                                ops.translate, ops.cutout, ops.brightness_contrast, ops.normalize])
def test_kernels_pickle(fn):
    assert pickle.loads(pickle.dumps(fn)) is fn


def test_oracle_itself_matches_a_hand_example():
    img = np.arange(9, dtype=np.uint8).reshape(1, 3, 3)
    assert ref_shift_flip(img, 1, 0, False, "zero")[0].tolist() == [[3, 4, 5], [6, 7, 8], [0, 0, 0]]
    assert ref_shift_flip(img, 0, -1, False, "reflect")[0].tolist() == [[1, 0, 1], [4, 3, 4],
                                                                        [7, 6, 7]]


# --- crops that change the scale (image folders) ---------------------------------------------


def _pil_resized_crop(img: np.ndarray, top, left, height, width, size) -> np.ndarray:
    """Oracle: Pillow's bilinear resize of the box (upscaling, where Pillow does no antialiasing)."""
    from PIL import Image
    planes = [np.asarray(Image.fromarray(np.ascontiguousarray(plane)).resize(
        size[::-1], Image.BILINEAR, box=(left, top, left + width, top + height))) for plane in img]
    return np.stack(planes)


def test_resized_crop_matches_pillow_within_one_level():
    rng = np.random.default_rng(5)
    images = rng.integers(0, 256, (12, 3, 20, 24), dtype=np.uint8)
    top, left = rng.integers(0, 8, 12), rng.integers(0, 8, 12)
    height, width = rng.integers(4, 13, 12), rng.integers(4, 17, 12)
    out = augment.resized_crop(images, top, left, height, width, (20, 24))
    for i in range(12):
        ref = _pil_resized_crop(images[i], top[i], left[i], height[i], width[i], (20, 24))
        assert np.abs(out[i].astype(int) - ref).max() <= 1, i


def test_resized_crop_identity_box_and_fused_flip(images):
    n = len(images)
    full = (np.zeros(n, int), np.zeros(n, int), np.full(n, 32), np.full(n, 32))
    np.testing.assert_array_equal(augment.resized_crop(images, *full, (32, 32)), images)
    mask = np.arange(n) % 3 == 0
    np.testing.assert_array_equal(augment.resized_crop(images, *full, (32, 32), flip=mask),
                                  augment.flip(images, mask))


def test_resized_crop_refuses_boxes_outside_the_image(images):
    n = len(images)
    with pytest.raises(ValueError, match="crop boxes must lie inside the 32x32 images"):
        augment.resized_crop(images, np.full(n, 20), np.zeros(n, int), np.full(n, 16),
                             np.full(n, 8), (32, 32))


def test_random_resized_crop_boxes_follow_scale_and_ratio():
    op = augment.RandomResizedCrop(scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3))
    params = op.sample(np.random.default_rng(0), 2000)
    top, left, h, w = op.boxes(params, 64, 48)
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 64).all() and (left + w <= 48).all()
    area = h * w / (64 * 48)
    assert area.min() >= 0.2 and area.max() <= 1.0 and np.median(area) > 0.4
    assert ((w / h) > 0.6).all() and ((w / h) < 1.45).all()


def test_resized_crop_policy_is_seeded_and_same_shape():
    policy = augment.get_policy("resized-crop")
    x = np.random.default_rng(2).integers(0, 256, (9, 3, 40, 40), dtype=np.uint8)
    a = policy(x, np.random.default_rng(7))
    b = policy(x, np.random.default_rng(7))
    assert a.shape == x.shape and a.dtype == np.uint8 and (a == b).all()
    assert not (a == policy(x, np.random.default_rng(8))).all()
