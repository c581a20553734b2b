"""Models and the Chainer functions they use, checked under the NumPy that is installed."""
import pickle

import numpy as np
import pytest

from pipeline.backends.chainer.compat import F, chainer, gradient_check, serializers
from pipeline.backends.chainer.models import MODELS, build_model, count_parameters
from pipeline.backends.chainer.state import get_state, set_state

# Chainer's functions are the reference here, not our dispatchers
pytestmark = pytest.mark.usefixtures("chainers_own_functions")
RNG = np.random.default_rng(0)


def _x(*shape):
    return RNG.standard_normal(shape)  # float64: numerical gradients need the precision


# Every Chainer function the registry's models call, with float64 inputs.
FUNCTIONS = {
    "convolution_2d": (lambda x, W, b: F.convolution_2d(x, W, b, stride=1, pad=1),
                       [_x(2, 3, 6, 6), _x(4, 3, 3, 3), _x(4)]),
    "convolution_2d_stride2_nobias": (lambda x, W: F.convolution_2d(x, W, stride=2, pad=1),
                                      [_x(2, 3, 6, 6), _x(4, 3, 3, 3)]),
    "linear": (lambda x, W, b: F.linear(x, W, b), [_x(3, 5), _x(4, 5), _x(4)]),
    "relu": (F.relu, [_x(3, 4) + np.sign(_x(3, 4)) * 0.1]),
    # distinct values so the max is unambiguous under the finite difference
    "max_pooling_2d": (lambda x: F.max_pooling_2d(x, 3, stride=2),
                       [RNG.permutation(2 * 2 * 7 * 7).reshape(2, 2, 7, 7) / 10.0]),
    "average_pooling_2d": (lambda x: F.average_pooling_2d(x, 2), [_x(2, 2, 4, 4)]),
    "spatial_pyramid_pooling_2d": (lambda x: F.spatial_pyramid_pooling_2d(x, 3, pooling="max"),
                                   [RNG.permutation(2 * 2 * 8 * 8).reshape(2, 2, 8, 8) / 10.0]),
    "dropout_with_mask": (lambda x: F.dropout(x, 0.5, mask=(np.arange(12).reshape(3, 4) % 2) * 2.0),
                          [_x(3, 4)]),
    "batch_normalization": (lambda x, g, b: F.batch_normalization(x, g, b),
                            [_x(4, 3, 2, 2), _x(3), _x(3)]),
    "mean": (lambda x: F.mean(x, axis=(2, 3)), [_x(2, 3, 4, 4)]),
    "softmax": (F.softmax, [_x(3, 5)]),
    "softmax_cross_entropy": (lambda x: F.softmax_cross_entropy(x, np.array([0, 2, 4], np.int32)),
                              [_x(3, 5)]),
    "add": (lambda a, b: a + b, [_x(2, 3), _x(2, 3)]),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_check_backward(name):
    func, inputs = FUNCTIONS[name]
    out = func(*inputs)
    grad = RNG.standard_normal(out.shape) if out.shape else None
    gradient_check.check_backward(func, tuple(inputs), grad, dtype=np.float64, atol=1e-4,
                                  rtol=1e-4)


def test_compat_shims_are_in_place_and_scoped():
    import sys
    assert chainer.__version__ == "7.8.1"
    assert "int" in np.sctypes  # needed by chainer.functions.array.as_strided at run time
    stub = sys.modules.get("numpy.distutils")
    assert stub is None or hasattr(stub, "__file__")  # the real one, or nothing: no stub left


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_shape_and_dtype(name):
    model = build_model(name, n_classes=7, seed=0)
    x = RNG.standard_normal((2, 3, 32, 32)).astype(np.float32)
    with chainer.using_config("train", False):
        y = model(x)
    assert y.shape == (2, 7) and y.dtype == np.float32


@pytest.mark.parametrize("name", sorted(MODELS))
def test_npz_round_trip(name, tmp_path):
    model = build_model(name, seed=1)
    serializers.save_npz(str(tmp_path / "m.npz"), model)
    other = build_model(name, seed=2)
    serializers.load_npz(str(tmp_path / "m.npz"), other)
    a, b = get_state(model), get_state(other)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_seed_fixes_initial_weights():
    a, b, c = (get_state(build_model("resnet20", seed=s)) for s in (3, 3, 4))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["conv1/W"], c["conv1/W"])


def test_state_round_trip_and_keys():
    model = build_model("resnet20", seed=0)
    state = get_state(model)
    assert "conv1/W" in state and "bn1/avg_mean" in state and state["bn1/N"].dtype.kind == "i"
    blank = set_state(build_model("resnet20", seed=9), state)
    assert all(np.array_equal(get_state(blank)[k], v) for k, v in state.items())
    assert pickle.loads(pickle.dumps(state)).keys() == state.keys()


def test_dropout_needs_explicit_rng_in_train_mode():
    model = build_model("cifar10-2015", seed=0)
    x = np.zeros((1, 3, 32, 32), np.float32)
    with chainer.using_config("train", True):
        with pytest.raises(ValueError, match="rng"):
            model(x)
        a = model(x, rng=np.random.default_rng(5)).array
        b = model(x, rng=np.random.default_rng(5)).array
    assert np.array_equal(a, b)


def test_sizes():
    assert count_parameters(build_model("cifar10-2015")) == 5_629_418
    assert 0.26e6 < count_parameters(build_model("resnet20")) < 0.28e6


def test_unknown_model_names_the_field():
    with pytest.raises(ValueError, match="model.name"):
        build_model("vgg99")


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("side", [64, 40])
def test_models_run_at_other_input_sizes_with_the_same_parameters(name, side):
    """Image folders feed --image-size inputs: same parameter shapes, (N, classes) logits, and
    gradients that reach the first layer."""
    model = build_model(name, 5, seed=0)
    shapes = {path: p.shape for path, p in model.namedparams()}
    x = np.random.default_rng(0).normal(size=(2, 3, side, side)).astype(np.float32)
    with chainer.using_config("train", True):
        loss = F.softmax_cross_entropy(model(x, rng=np.random.default_rng(0)), np.array([0, 4]))
    model.cleargrads()
    loss.backward()
    assert {path: p.shape for path, p in model.namedparams()} == shapes
    first = model.conv1 if hasattr(model, "conv1") else model.fc1  # wide-mlp: no convolution
    assert np.isfinite(float(loss.array)) and np.abs(first.W.grad).sum() > 0
