"""Policies: sampling from explicit generators, fused vs op-by-op apply, pickling, and position-keyed params."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, strategies as st

import augment
from augment import (POLICIES, BrightnessContrast, Compose, Cutout, Flip, PadCrop, Translate,
                     get_policy, sample_for_positions, take_params)
from tests.augment.conftest import ALL_OPS, AUGMENT, ref_batch

POLICY_LIST = list(POLICIES.values()) + [ALL_OPS]


def _chunk_rng(seed):
    return lambda j: np.random.default_rng([seed, j])


@pytest.mark.parametrize("policy", POLICY_LIST, ids=repr)
def test_sample_shapes_and_apply_keeps_shape_and_dtype(policy, images):
    params = policy.sample(np.random.default_rng(0), len(images))
    assert len(params) == len(policy.ops)
    assert all(len(v) == len(images) for part in params for v in part.values())
    out = policy.apply(images, params)
    assert out.shape == images.shape and out.dtype == np.uint8


@pytest.mark.parametrize("policy", POLICY_LIST, ids=repr)
def test_same_generator_same_bytes_other_seed_other_bytes(policy, images):
    a = policy(images, np.random.default_rng(7))
    b = policy(images, np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)
    if policy.ops:
        assert not np.array_equal(a, policy(images, np.random.default_rng(8)))


def test_none_policy_is_identity(images):
    assert get_policy("none")(images, np.random.default_rng(0)) is images


def test_fused_apply_equals_op_by_op(images):
    params = ALL_OPS.sample(np.random.default_rng(3), len(images))
    step = images
    for op, part in zip(ALL_OPS.ops, params):
        step = op.apply(step, part)
    np.testing.assert_array_equal(ALL_OPS.apply(images, params), step)


def test_cifar_policy_is_pad4_crop_and_flip(images):
    policy = get_policy("cifar")
    assert policy == Compose([PadCrop(4), Flip(0.5)])
    (crop, flip) = policy.sample(np.random.default_rng(4), len(images))
    expected = ref_batch(images, crop["dy"] - 4, crop["dx"] - 4, flip["flip"], "zero")
    np.testing.assert_array_equal(policy.apply(images, (crop, flip)), expected)


def test_flip_probability_and_crop_offsets_are_uniform():
    crop, flip = get_policy("cifar").sample(np.random.default_rng(0), 90_000)
    assert abs(flip["flip"].mean() - 0.5) < 0.01
    counts = np.bincount(crop["dy"], minlength=9)
    assert counts.size == 9 and np.abs(counts / 10_000 - 1).max() < 0.05


@pytest.mark.parametrize("policy", POLICY_LIST, ids=repr)
def test_policies_pickle_repr_and_hash(policy):
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert eval(repr(policy), vars(augment)) == policy
    assert hash(policy) == hash(pickle.loads(pickle.dumps(policy)))


def test_get_policy_names_the_field():
    assert set(POLICIES) >= {"none", "flip", "cifar", "cifar-cutout"}
    with pytest.raises(ValueError, match=r"augment.policy must be one of \['none', 'flip', 'cifar', "
                                         r"'cifar-cutout', 'resized-crop'\], got 'x'"):
        get_policy("x")


@pytest.mark.parametrize("make, message", [
    (lambda: PadCrop(-1), "PadCrop.pad must be an int >= 0, got -1"),
    (lambda: PadCrop(4, "wrap"), "PadCrop.mode must be one of"),
    (lambda: Flip(1.5), r"Flip.p must be in \[0, 1\], got 1.5"),
    (lambda: Translate(2.5), "Translate.max_shift must be an int"),
    (lambda: Cutout(-2), "Cutout.size must be an int >= 0"),
    (lambda: BrightnessContrast(1.0, 0.1), r"BrightnessContrast.brightness must be in \[0, 1\)"),
    (lambda: Compose([lambda x: x]), "Compose.ops must hold ops"),
])
def test_op_validation_names_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_apply_checks_params_rows(images):
    policy = get_policy("cifar")
    params = policy.sample(np.random.default_rng(0), len(images) + 1)
    with pytest.raises(ValueError, match=r"params\['dy'\] must have one row per image \(37\)"):
        policy.apply(images, params)
    with pytest.raises(ValueError, match="params must have one dict per op"):
        policy.apply(images, params[:1])


def test_take_params_rows_slices_and_masks():
    params = ({"a": np.arange(5)}, {"b": np.arange(5) * 10})
    assert take_params(params, slice(1, 3))[1]["b"].tolist() == [10, 20]
    assert take_params(params, np.arange(5) > 2)[0]["a"].tolist() == [3, 4]


@AUGMENT
@given(st.integers(1, 7), st.integers(0, 40), st.integers(1, 4), st.randoms(use_true_random=False))
def test_params_of_a_position_do_not_depend_on_the_split(chunk, n, parts, random):
    """Split an epoch's positions among replicas/rounds any way: each position gets the same params."""
    policy, rngs = get_policy("cifar-cutout"), _chunk_rng(11)
    whole = sample_for_positions(policy, rngs, np.arange(n), chunk)
    order = list(range(n))
    random.shuffle(order)
    cuts = sorted(random.randint(0, n) for _ in range(parts - 1))
    for piece in np.split(np.array(order, np.int64), cuts):
        got = sample_for_positions(policy, rngs, piece, chunk)
        for mine, full in zip(got, take_params(whole, piece)):
            for name in full:
                np.testing.assert_array_equal(mine[name], full[name])


def test_positions_use_row_p_mod_chunk_of_chunk_p_div_chunk():
    policy, rngs = get_policy("cifar"), _chunk_rng(2)
    got = sample_for_positions(policy, rngs, np.array([13, 4, 5]), 5)
    chunks = {j: policy.sample(rngs(j), 5) for j in (0, 1, 2)}
    for op in (0, 1):
        for name in got[op]:
            expected = [chunks[2][op][name][3], chunks[0][op][name][4], chunks[1][op][name][0]]
            assert got[op][name].tolist() == expected
    empty = sample_for_positions(policy, rngs, np.array([], np.int64), 5)
    assert [len(v) for part in empty for v in part.values()] == [0, 0, 0]
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        sample_for_positions(policy, rngs, np.arange(3), 0)


def test_augment_imports_neither_dask_nor_chainer_nor_matplotlib():
    import subprocess
    import sys
    code = ("import sys, augment; bad = [m for m in ('dask', 'distributed', 'chainer', 'matplotlib')"
            " if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert result.returncode == 0, result.stdout + result.stderr
