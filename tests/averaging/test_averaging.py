"""Tests for pipeline.averaging.exact: exact typed means against NumPy, trees, weights, outer step."""
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.averaging import exact
from pipeline.averaging.exact import Partial, combine, finalize, leaf, outer_step
from pipeline.averaging.reduction import reduce_local
from tests.helpers import make_states

DTYPES = (np.float16, np.float32, np.float64)


def numpy_mean(states, key, weights=None):
    stack = np.stack([s[key] for s in states]).astype(np.float64)
    return np.average(stack, axis=0, weights=weights).astype(states[0][key].dtype)


def tree(states, fan_in, weights=None):
    items = states if weights is None else [leaf(s, w) for s, w in zip(states, weights)]
    return reduce_local(items, combine, finalize, fan_in=fan_in)


@pytest.mark.parametrize("fan_in", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_mean_matches_numpy(fan_in, k, dtype):
    states = make_states(k, seed=k * 10 + fan_in, dtype=dtype)
    out = tree(states, fan_in)
    for key in ("/conv1/W", "/conv1/b", "/bn1/avg_mean", "/fc/W"):
        assert out[key].dtype == dtype
        expected = numpy_mean(states, key)
        if dtype == np.float64:  # reassociation rounding only
            np.testing.assert_allclose(out[key], expected, rtol=1e-13, atol=1e-15)
        else:  # sums of float32/float16 are exact in float64: identical bits
            np.testing.assert_array_equal(out[key], expected)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_integer_entries_come_from_the_first_replica_untouched(k):
    states = make_states(k, seed=1)
    out = tree(states, fan_in=2)
    assert out["/bn1/N"] is states[0]["/bn1/N"]
    assert out["/bn1/N"].dtype == np.int64 and int(out["/bn1/N"]) == 100


def test_weighted_mean_carries_sums_not_means():
    states = make_states(3, seed=2)
    weights = [100, 1, 7]
    out = tree(states, fan_in=2, weights=weights)
    np.testing.assert_array_equal(out["/conv1/W"], numpy_mean(states, "/conv1/W", weights))
    # averaging the averages of the uneven groups {0, 1} and {2} is what the sums avoid
    wrong = (np.mean([s["/conv1/W"] for s in states[:2]], axis=0, dtype=np.float64)
             + states[2]["/conv1/W"]) / 2
    assert not np.allclose(out["/conv1/W"], wrong)


def test_gradient_mean_is_sum_of_counts_times_means_over_total():
    rng = np.random.default_rng(3)
    per_sample = rng.standard_normal((10, 5)).astype(np.float32)  # 10 samples' gradients
    shards = [per_sample[:6], per_sample[6:9], per_sample[9:]]
    grads = [{"/W": s.mean(axis=0, dtype=np.float64).astype(np.float32)} for s in shards]
    out = exact.mean(grads, weights=[len(s) for s in shards])
    np.testing.assert_allclose(out["/W"], per_sample.mean(axis=0), rtol=1e-6)
    assert out["/W"].dtype == np.float32


@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 9), fan_a=st.integers(2, 5),
       fan_b=st.integers(2, 5), dtype=st.sampled_from(DTYPES))
@settings(max_examples=40, deadline=None, derandomize=True)
def test_result_does_not_depend_on_tree_shape(seed, k, fan_a, fan_b, dtype):
    states = make_states(k, seed, dtype)
    a, b = tree(states, fan_a), tree(states, fan_b)
    for key in a:
        if dtype == np.float64:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-13, atol=1e-15)
        else:
            np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.parametrize("fan_in", [2, 3])
def test_fixed_tree_is_bit_exact_on_rerun(fan_in):
    states = make_states(7, seed=4, dtype=np.float64)
    first, second = tree(states, fan_in), tree(states, fan_in)
    for key in first:
        assert first[key].tobytes() == second[key].tobytes()


def test_combine_accepts_raw_states_like_weight_one_leaves():
    states = make_states(3, seed=5)
    raw, leaves = combine(states), combine([leaf(s) for s in states])
    assert raw.count == leaves.count == 3
    for key in raw.sums:
        assert raw.sums[key].dtype == np.float64
        np.testing.assert_array_equal(raw.sums[key], leaves.sums[key])


def test_inputs_are_not_modified():
    states = make_states(3, seed=6)
    copies = [{k: v.copy() for k, v in s.items()} for s in states]
    partials = [leaf(s, 2) for s in states]
    sums_before = [p.sums["/conv1/W"].copy() for p in partials]
    tree(states, 2)
    finalize(combine(partials))
    for s, c in zip(states, copies):
        for key in s:
            np.testing.assert_array_equal(s[key], c[key])
    for p, before in zip(partials, sums_before):
        np.testing.assert_array_equal(p.sums["/conv1/W"], before)


def test_finalize_like_sets_dtypes_and_order():
    states = make_states(2, seed=7)
    like = {"/bn1/N": np.int64, "/fc/W": np.float64, "/conv1/W": np.float16,
            "/conv1/b": np.float32, "/bn1/avg_mean": np.float32}
    out = finalize(combine(states), like=like)
    assert list(out) == list(like)
    assert out["/fc/W"].dtype == np.float64 and out["/conv1/W"].dtype == np.float16


def test_errors_name_the_entry():
    a, b = make_states(2, seed=8)
    with pytest.raises(ValueError, match="/fc/W"):
        combine([a, {k: v for k, v in b.items() if k != "/fc/W"}])
    with pytest.raises(ValueError, match="/conv1/b"):
        combine([a, {**b, "/conv1/b": np.zeros(5, np.float32)}])
    with pytest.raises(ValueError, match="weight"):
        leaf(a, weight=0)
    with pytest.raises(ValueError, match="at least one"):
        combine([])
    with pytest.raises(ValueError, match="like="):
        finalize(Partial({"/W": np.ones(1)}, 1, {}))


def test_outer_step_with_lr_one_and_no_momentum_is_exactly_the_average():
    rng = np.random.default_rng(9)
    prev = {"/W": rng.standard_normal(1000).astype(np.float32) * 1e6, "/N": np.array(3)}
    avg = {"/W": rng.standard_normal(1000).astype(np.float32) * 1e-6, "/N": np.array(4)}
    new, buf = outer_step(prev, avg, None, lr=1.0, momentum=0.0)
    assert buf is None
    assert new["/W"].tobytes() == avg["/W"].tobytes() and new["/N"] is avg["/N"]


def test_outer_step_nesterov_matches_torch_sgd_formula():
    prev = {"/W": np.array([1.0, -2.0], np.float32), "/N": np.array(7)}
    avg1 = {"/W": np.array([0.5, -1.0], np.float32), "/N": np.array(8)}
    new1, buf1 = outer_step(prev, avg1, None, lr=0.7, momentum=0.9)
    delta1 = np.array([0.5, -1.0])
    np.testing.assert_allclose(buf1["/W"], delta1)
    np.testing.assert_allclose(new1["/W"], prev["/W"] - 0.7 * (delta1 + 0.9 * delta1), rtol=1e-6)
    assert new1["/N"] is avg1["/N"] and new1["/W"].dtype == np.float32 and "/N" not in buf1
    avg2 = {"/W": new1["/W"] - np.float32(0.25), "/N": np.array(9)}
    new2, buf2 = outer_step(new1, avg2, buf1, lr=0.7, momentum=0.9, nesterov=False)
    delta2 = new1["/W"].astype(np.float64) - avg2["/W"]
    np.testing.assert_allclose(buf2["/W"], 0.9 * delta1 + delta2)
    np.testing.assert_allclose(new2["/W"], new1["/W"] - 0.7 * buf2["/W"], rtol=1e-6)


def test_outer_step_validates():
    s = {"/W": np.ones(1, np.float32)}
    with pytest.raises(ValueError, match="lr"):
        outer_step(s, s, None, lr=0.0, momentum=0.0)
    with pytest.raises(ValueError, match="momentum"):
        outer_step(s, s, None, lr=1.0, momentum=1.0)


def test_nbytes_and_finiteness():
    s = {"/a": np.zeros((2, 2), np.float32), "/N": np.array(1, np.int64),
         "/b": np.array([1.0, np.inf], np.float16)}
    assert exact.nbytes(s) == 16 + 8 + 4
    assert exact.first_nonfinite(s) == "/b" and not exact.is_finite(s)
    assert exact.is_finite({"/a": np.ones(2), "/N": np.array(1)})


@pytest.mark.parametrize("fn", [leaf, combine, finalize, exact.combine_finalize,
                                outer_step, exact.mean,
                                exact.nbytes, exact.is_finite, exact.first_nonfinite])
def test_functions_pickle_round_trip(fn):
    assert pickle.loads(pickle.dumps(fn)) is fn


def test_partial_pickle_round_trip():
    p = combine([leaf(s, 3) for s in make_states(2, seed=10)])
    q = pickle.loads(pickle.dumps(p))
    assert isinstance(q, Partial) and q.count == p.count and q.dtypes == p.dtypes
    for key in p.sums:
        np.testing.assert_array_equal(q.sums[key], p.sums[key])
    assert finalize(q)["/fc/W"].tobytes() == finalize(p)["/fc/W"].tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_finalize_is_finalize_of_combine_bit_for_bit(dtype):
    states = make_states(5, seed=11, dtype=dtype)
    states[0]["/big"] = np.random.default_rng(11).standard_normal(70_000).astype(dtype)
    for s in states[1:]:  # longer than one block
        s["/big"] = states[0]["/big"][::-1].copy()
    items = [states[0], leaf(states[1], 3), combine(states[2:4]), states[4]]
    like = {**{k: np.float32 for k in states[0]}, "/bn1/N": np.int64}
    for kwargs in ({}, {"like": like}):
        fused, split = (exact.combine_finalize(items, **kwargs),
                        finalize(combine(items), **kwargs))
        assert list(fused) == list(split)
        for key in split:
            assert fused[key].dtype == split[key].dtype
            assert fused[key].tobytes() == split[key].tobytes(), key


# ---- the compiled mean (pipeline.averaging.compiled) ------------------------------------------

def _numpy_blocks_only(monkeypatch):
    from pipeline.averaging import compiled
    monkeypatch.setattr(compiled, "MIN_SIZE", 1 << 62)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_the_compiled_mean_gives_the_numpy_blocks_bits(monkeypatch, k, dtype):
    """One compiled pass per entry against the five NumPy passes per block it replaces: the
    same bits for float32 and float64 states (sums that are not exact in float64 too), any K,
    integer and fractional total weights, sizes off the block size."""
    from pipeline.averaging import compiled
    if compiled._kernel() is None:
        pytest.skip("Numba cannot be imported here: the NumPy blocks are the only path")
    rng = np.random.default_rng(k)
    size = compiled.MIN_SIZE + 12345
    states = [{"/big": (rng.standard_normal(size) * 10.0 ** rng.integers(-30, 30, size))
               .astype(dtype), "/N": np.array(3)} for _ in range(k)]
    weighted = [exact.leaf(s, w) for s, w in zip(states, [0.5, 3, 1.25, 2, 7][:k])]
    fast = exact.combine_finalize(states), exact.finalize(exact.combine(weighted))
    _numpy_blocks_only(monkeypatch)
    slow = exact.combine_finalize(states), exact.finalize(exact.combine(weighted))
    for a, b in zip(fast, slow):
        assert a.keys() == b.keys()
        assert all(a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes()
                   for key in a)


def test_the_compiled_mean_declines_what_it_does_not_cover():
    from pipeline.averaging import compiled
    n = compiled.MIN_SIZE
    ones = np.ones(n, np.float32)
    out = np.zeros(n, np.float32)
    assert not compiled.mean_into([ones[:10]], 1, out[:10])  # small: NumPy
    assert not compiled.mean_into([ones.astype(np.float16)], 1, out.astype(np.float16))
    assert not compiled.mean_into([ones, ones.astype(np.float64)], 2, out)  # mixed dtypes
    assert not compiled.mean_into([np.ones(2 * n, np.float32)[::2]], 1, out)  # strided
    assert not out.any()  # nothing written when it says no
