"""Tests for pipeline.averaging.cost: the formulas by hand, the tree plan, speedup limits."""
import dataclasses
import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.averaging import cost
from pipeline.averaging.cost import (HUNDRED_GBPS, TEN_GBE, Link, LocalCosts, Workload, comm_time,
                                     efficiency, ring_allreduce_time, round_time, speedup,
                                     tree_allreduce_time, tree_widths)

RESNET50 = Workload(compute_s_per_sample=1 / 367, batch_size=32, model_bytes=102_228_384)
NET = Link(bandwidth=1e9, latency=0.0)


def test_ring_is_the_2L_p_minus_1_over_p_formula_without_local_terms():
    for p in (2, 3, 4, 16):
        assert ring_allreduce_time(1e8, p, NET) == pytest.approx(2 * 1e8 * (p - 1) / p / 1e9)
    assert ring_allreduce_time(1e8, 1, NET) == 0.0
    with_latency = ring_allreduce_time(1e8, 4, Link(bandwidth=1e9, latency=1e-3))
    assert with_latency == pytest.approx(0.15 + 6e-3)


def test_tree_widths_follow_the_graph_plan():
    from pipeline.averaging.reduction import tree_plan
    for p in range(1, 40):
        for f in (2, 3, 4, 8):
            plan = tree_plan(p, f)  # level l's width is the number of groups below it
            assert tree_widths(p, f) == [p] + [len(groups) for groups in plan[:-1]]


def test_tree_time_by_hand():
    local = LocalCosts(reduce_s_per_byte=1e-10, finalize_s_per_byte=2e-10, task_s=0.01)
    L = 1e8
    # p = 4, fan-in 2: level 0 two pairs (L each), level 1 one pair of float64 partials (2L)
    reduce_ = (0.01 + L / 1e9 + 2 * L * 1e-10) + (0.01 + 2 * L / 1e9 + 2 * L * 1e-10) + L * 2e-10
    star = 0.01 + 3 * L / 1e9
    binomial = 0.01 + 2 * L / 1e9
    assert tree_allreduce_time(L, 4, NET, local) == pytest.approx(reduce_ + star)
    assert tree_allreduce_time(L, 4, NET, local, broadcast="binomial") == pytest.approx(
        reduce_ + binomial)
    flat = 0.01 + 3 * L / 1e9 + 4 * L * 1e-10 + L * 2e-10 + star
    assert tree_allreduce_time(L, 4, NET, local, fan_in=4) == pytest.approx(flat)


@pytest.mark.parametrize("link", [TEN_GBE, HUNDRED_GBPS])
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_speedup_limits(link, algorithm):
    for strategy, H in (("gradient", 1), ("ipm", 8), ("ipm", 32)):
        kwargs = dict(strategy=strategy, H=H, algorithm=algorithm)
        assert speedup(RESNET50, 1, link, **kwargs) == 1.0
        for p in (2, 16, 256):
            s = speedup(RESNET50, p, link, cost.THIS_MACHINE, **kwargs)
            assert 0 < s < p
            eff = efficiency(RESNET50, p, link, cost.THIS_MACHINE, **kwargs)
            assert eff == pytest.approx(s / p)


def test_longer_rounds_and_faster_links_scale_better():
    for p in (4, 64, 256):
        grad = speedup(RESNET50, p, TEN_GBE, strategy="gradient")
        h8 = speedup(RESNET50, p, TEN_GBE, strategy="ipm", H=8)
        h32 = speedup(RESNET50, p, TEN_GBE, strategy="ipm", H=32)
        assert grad < h8 < h32
        assert speedup(RESNET50, p, HUNDRED_GBPS, strategy="ipm", H=8) > h8
        assert (speedup(RESNET50, p, TEN_GBE, strategy="ipm", H=8, algorithm="ring")
                > speedup(RESNET50, p, TEN_GBE, strategy="ipm", H=8, algorithm="tree"))


def test_gradient_ignores_H_and_round_time_adds_compute():
    a = round_time(RESNET50, 8, TEN_GBE, strategy="gradient", H=32)
    b = round_time(RESNET50, 8, TEN_GBE, strategy="gradient", H=1)
    assert a == b == pytest.approx(RESNET50.step_s + comm_time(RESNET50.model_bytes, 8, TEN_GBE))


@given(p=st.integers(2, 512), fan_in=st.integers(2, 16), nbytes=st.floats(1e3, 1e10))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_ring_never_slower_than_tree_on_bandwidth(p, fan_in, nbytes):
    # with no latency or local terms the ring moves the fewest bytes per worker
    assert (ring_allreduce_time(nbytes, p, NET)
            <= tree_allreduce_time(nbytes, p, NET, fan_in=fan_in, broadcast="binomial") + 1e-12)


def test_validation_names_the_field():
    with pytest.raises(ValueError, match="link.bandwidth"):
        Link(bandwidth=0)
    with pytest.raises(ValueError, match="workload.batch_size"):
        Workload(compute_s_per_sample=1e-3, batch_size=0, model_bytes=1)
    with pytest.raises(ValueError, match="local.task_s"):
        LocalCosts(task_s=-1)
    with pytest.raises(ValueError, match="strategy"):
        round_time(RESNET50, 2, TEN_GBE, strategy="mixture")
    with pytest.raises(ValueError, match="algorithm"):
        comm_time(1.0, 2, TEN_GBE, algorithm="butterfly")
    with pytest.raises(ValueError, match="fan_in"):
        tree_widths(4, 1)
    with pytest.raises(ValueError, match="^p "):
        ring_allreduce_time(1.0, 0, TEN_GBE)


def test_config_objects_are_frozen_and_pickle():
    for obj in (TEN_GBE, cost.THIS_MACHINE, RESNET50):
        assert pickle.loads(pickle.dumps(obj)) == obj
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.__setattr__(dataclasses.fields(obj)[0].name, 1)
    for fn in (speedup, efficiency, round_time, comm_time):
        assert pickle.loads(pickle.dumps(fn)) is fn
    assert math.isclose(RESNET50.step_s, 32 / 367)
