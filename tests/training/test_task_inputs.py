"""A Dask task never changes its inputs: every task function leaves them byte-identical.

A replay after a lost worker, or a second consumer of the same key, must see the values the first
one saw. Each function here is called on read-only inputs (an in-place write raises) and its
inputs are compared byte for byte with copies taken before the call.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

from pipeline.data import augment as augment_graph
from pipeline.averaging import exact
from pipeline.core import npz
from pipeline.training import tasks
from pipeline.backends.chainer.compat import serializers
from pipeline.training.strategies import asynchronous, ipm
from pipeline.core.rng import rng_for
from pipeline.backends.chainer.models import build_model
from pipeline.backends.chainer.state import (get_state, load_npz, make_optimizer, set_optimizer_state,
                                             setup_optimizer)
from pipeline.data.readers import Shard
from tests.helpers import assert_same_bits

MODEL, CLASSES = "small-cnn", 10


def _read_only(value):
    """A deep copy of ``value`` whose every array refuses writes."""
    value = copy.deepcopy(value)
    for array in _arrays(value):
        array.setflags(write=False)
    return value


def _arrays(value):
    if isinstance(value, np.ndarray):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _arrays(v)
    elif isinstance(value, (list, tuple)):  # NamedTuples too
        for v in value:
            yield from _arrays(v)


def _fingerprint(value) -> list:
    return [(a.dtype.str, a.shape, a.tobytes()) for a in _arrays(value)]


def _call_untouched(func, *args):
    """``func(*read-only copies of args)``; asserts the inputs came back byte-identical."""
    frozen = tuple(_read_only(a) for a in args)
    before = _fingerprint(frozen)
    result = func(*frozen)
    assert _fingerprint(frozen) == before, f"{func.__name__} changed its inputs"
    return result


def _spec(optimizer="momentum", mode="steps", steps=2) -> tasks.StepSpec:
    return tasks.StepSpec(MODEL, CLASSES, optimizer, 0.9, 1e-4, (0.05,) * steps, 4, mode,
                          seed=0, round=1, replica=0)


def _shard(n=8) -> Shard:
    rng = rng_for(0, "test-inputs")
    return Shard(rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8),
                       rng.integers(0, CLASSES, n).astype(np.int32))


@pytest.fixture(scope="module")
def params():
    return tasks.init_params(MODEL, CLASSES, seed=0)


@pytest.fixture(scope="module")
def warm(params):
    """Params and a momentum optimizer state with its slots created (after one round)."""
    result = tasks.train(params, None, _shard(), _spec())
    return result.params, result.opt


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("fresh", [False, True], ids=["with state", "fresh optimizer"])
def test_train_leaves_params_optimizer_state_and_shard_untouched(warm, optimizer, fresh):
    params, _ = warm
    opt = tasks.train(params, None, _shard(), _spec(optimizer)).opt  # slots of this optimizer
    # momentum's v, Adam's m and v: the slots Chainer used to adopt (SGD has none)
    assert optimizer == "sgd" or any(k.endswith(("/v", "/m")) for k in opt)
    result = _call_untouched(tasks.train, params, None if fresh else opt, _shard(),
                             _spec(optimizer))
    assert result.metrics["finite"]


def test_ipm_packing_of_averaged_optimizer_state_leaves_its_inputs_untouched(warm):
    params, opt = warm
    packed = _call_untouched(ipm.pack, (params, opt, {}))
    _call_untouched(ipm.unpack, packed)
    # where the averaging algorithms pack a train result: a tree's leaf, a shard's cut, a
    # host's local sum
    from pipeline.averaging.algorithms import base, tree
    from pipeline.averaging.order import build
    _call_untouched(tree._leaf, (params, opt, {}), ipm.pack)
    _call_untouched(base.take_payload, ipm.pack, (params, opt, {}), 3, 1)
    _call_untouched(base.local_sum, build(2, 2), build(2, 2),
                    {0: (params, opt, {}), 1: (params, opt, {})}, ipm.pack)


def test_gradient_mode_and_update_leave_their_inputs_untouched(warm):
    params, opt = warm
    grad = _call_untouched(tasks.train, params, None, _shard(), _spec(mode="gradient")).params
    new_params, new_opt = _call_untouched(tasks.update, params, opt, grad, _spec())
    assert new_params.keys() == params.keys() and new_opt.keys() == opt.keys()
    _call_untouched(asynchronous.apply_gradient, params, opt, grad, 0.5, _spec())


def test_evaluation_leaves_its_inputs_untouched(warm):
    params, _ = warm
    shard = _shard(6)
    spec = tasks.EvalSpec(MODEL, CLASSES, tta=True, batch_size=4)
    _call_untouched(tasks.evaluate, params, shard.images, shard.labels, spec)
    _call_untouched(tasks.predict_proba, params, shard.images, spec)


def test_the_task_functions_of_the_graph_leave_their_inputs_untouched(warm):
    params, _ = warm
    shard = _shard(8)
    blocks = ([shard.images[:5], shard.images[5:]], [shard.labels[:5], shard.labels[5:]])
    _call_untouched(augment_graph.augment, *blocks, (0, 5), np.array([7, 0, 3, 5]), np.arange(4),
                    "cifar-cutout", 0, 0, 1000)
    other = {k: v + 1 if exact.is_float(v) else v for k, v in params.items()}
    mean = exact.mean([params, other])
    new, _, buf = _call_untouched(ipm.average_outer, params, mean, None, 0.7, 0.9, False)
    _call_untouched(ipm.average_outer, params, mean, buf, 0.7, 0.9, False,
                    [{"delta_sq": 1.0}, {"delta_sq": 2.0}])
    _call_untouched(asynchronous.apply, params, params, other, 0.5)
    partials = [_call_untouched(exact.leaf, p, 2) for p in (params, other)]
    _call_untouched(exact.combine, partials)
    _call_untouched(exact.finalize, exact.combine(partials))
    _call_untouched(exact.combine_finalize, [params, other])


def test_ipm_splits_a_packed_mean_as_its_plain_outer_step_does(warm):
    """The plain outer step (lr 1, no momentum) hands the mean back as it is; so ipm splits each
    copy of a packed mean (params and optimizer state) itself, next to its replica, with the
    bits the ``average_outer`` task gave."""
    params, opt = warm
    other = {k: v + 1 if exact.is_float(v) else v for k, v in params.items()}
    mean = exact.mean([ipm.pack((params, opt, {})), ipm.pack((other, opt, {}))])
    split = _call_untouched(ipm.unpack, mean)
    outer = ipm.average_outer(params, mean, None, 1.0, 0.0, True)
    assert_same_bits(split[0], outer[0])
    assert_same_bits(split[1], outer[1])
    assert outer[2] is None


def test_chainer_would_adopt_the_arrays_it_is_given():
    """Why the copy on the way in exists: loading into a fresh optimizer adopts the arrays."""
    model = build_model(MODEL, CLASSES)
    opt = setup_optimizer(make_optimizer("momentum", 0.1), model)
    state = {"t": np.array(0), "epoch": np.array(0)}
    for path, param in model.namedparams():
        state[path.lstrip("/") + "/t"] = np.array(0)
        state[path.lstrip("/") + "/v"] = np.zeros(param.shape, np.float32)
    serializers.NpzDeserializer(state, strict=True).load(opt)
    assert opt.target.conv1.W.update_rule.state["v"] is state["conv1/W/v"]  # adopted
    fresh = setup_optimizer(make_optimizer("momentum", 0.1), build_model(MODEL, CLASSES))
    set_optimizer_state(fresh, state)
    assert fresh.target.conv1.W.update_rule.state["v"] is not state["conv1/W/v"]  # ours copies


def test_loaded_weights_are_private_copies(tmp_path, params):
    path = tmp_path / "w.npz"
    path.write_bytes(npz.to_bytes(params, compress=True))
    model = load_npz(build_model(MODEL, CLASSES), str(path))
    assert _fingerprint(get_state(model)) == _fingerprint(params)


def test_a_train_task_measures_its_displacement_only_when_asked(params):
    """``delta_sq`` (what ipm's adaptive outer lr reads) is the squared distance the steps moved
    the params when the spec asks for it, else 0.0 with the same params: a pass over the state
    per task saved. The strategies ask for it exactly when the outer lr is adaptive."""
    from pipeline import Config
    from pipeline.core.schedule import plan_rounds
    from pipeline.training.strategies.base import Context
    asked = tasks.train(params, None, _shard(), _spec()._replace(displacement=True))
    plain = tasks.train(params, None, _shard(), _spec())
    assert asked.metrics["delta_sq"] == exact.squared_distance(asked.params, params) > 0
    assert plain.metrics["delta_sq"] == 0.0
    assert _fingerprint(asked.params) == _fingerprint(plain.params)
    rnd = plan_rounds(64, 2, 4, 1, 2)[0]
    for adaptive in (False, True):
        config = ipm.IPM.resolve(Config().replace(**{"average.adaptive_outer": adaptive}))
        spec = Context(config, 2, 64, 8, CLASSES, "cpu").spec(rnd, 0)
        assert spec.displacement is adaptive
