"""cuDNN graphs and the fused update on a CUDA GPU: Chainer's own functions and update rules are the reference.

Skipped where Chainer cannot use CUDA; under ``PIPELINE_REQUIRE_GPU=1`` a missing device or a
missing ``cudnn`` frontend is an error. Strict FP32 (``CUPY_TF32`` unset) is assumed.
"""
import os

import numpy as np
import pytest

from tests.gpu_guard import require_cuda

require_cuda()

import cupy  # noqa: E402

from pipeline.backends.chainer import cpu_kernels, gpu_kernels  # noqa: E402
from pipeline.backends.chainer.compat import F, chainer  # noqa: E402
from pipeline.backends.chainer.gpu_kernels import fused_update, graphs  # noqa: E402
from pipeline.backends.chainer.state import make_optimizer, setup_optimizer  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def frontend():
    os.environ.pop("CUPY_TF32", None)
    if graphs.load() is None:
        reason = f"the cuDNN frontend does not load: {graphs.unavailable_reason()}"
        if os.environ.get("PIPELINE_REQUIRE_GPU") == "1":
            raise RuntimeError(reason)
        pytest.skip(reason)


def _rand(rng, *shape, scale=1.0):
    return cupy.asarray((rng.standard_normal(shape) * scale).astype(np.float32))


def _close(actual, expected, rtol=2e-5, name=""):
    """Elementwise within rtol of the reference's largest magnitude (sums in another order)."""
    a, e = cupy.asnumpy(actual).astype(np.float64), cupy.asnumpy(expected).astype(np.float64)
    assert a.shape == e.shape, name
    scale = max(np.abs(e).max(), 1e-30)
    err = np.abs(a - e).max() / scale
    assert err <= rtol, (name, err)


CONV = [  # (N, C, H, W), (K, kh, kw), stride, pad, bias
    ((4, 3, 32, 32), (16, 3, 3), 1, 1, False),   # resnet20's first layer
    ((5, 16, 17, 17), (32, 3, 3), 2, 1, True),   # stride 2, odd size
    ((4, 16, 16, 16), (32, 1, 1), 2, 0, False),  # 1x1 projection, stride 2
    ((3, 3, 9, 11), (8, 5, 5), 1, 2, True),      # 5x5 pad 2 (cifar10-2015), non-square
    ((2, 32, 8, 8), (64, 5, 5), 1, 2, True),
]  # unequal strides and pads: test_gpu_kernels.py::test_conv_node_plumbing (keys and shapes)


@pytest.mark.parametrize("xs,ws,stride,pad,bias", CONV)
def test_convolution_matches_chainer_forward_and_backward(xs, ws, stride, pad, bias):
    rng = np.random.default_rng(0)
    x = _rand(rng, *xs)
    w = _rand(rng, ws[0], xs[1], ws[1], ws[2], scale=0.1)
    b = _rand(rng, ws[0]) if bias else None
    inputs = [x, w] + ([b] if bias else [])
    ours = [chainer.Variable(a.copy()) for a in inputs]
    theirs = [chainer.Variable(a.copy()) for a in inputs]
    y = gpu_kernels.convolution_2d(*ours[:2], ours[2] if bias else None, stride, pad)
    assert y is not None, "cuDNN could not build this convolution"
    assert isinstance(y.creator, gpu_kernels.functions.Convolution2D)
    with chainer.using_config("gpu_kernels", "chainer"):
        y_ref = F.convolution_2d(*theirs[:2], theirs[2] if bias else None, stride, pad)
    _close(y.array, y_ref.array, name="y")
    gy = _rand(rng, *y.shape)
    y.grad, y_ref.grad = gy, gy.copy()
    y.backward()
    y_ref.backward()
    for name, a, e in zip(("gx", "gW", "gb"), ours, theirs):
        _close(a.grad, e.grad, rtol=5e-5, name=name)


def test_convolution_is_deterministic():
    rng = np.random.default_rng(1)
    x, w = chainer.Variable(_rand(rng, 8, 16, 16, 16)), chainer.Variable(_rand(rng, 32, 16, 3, 3))
    grads = []
    for _ in range(2):
        x.cleargrad(), w.cleargrad()
        y = gpu_kernels.convolution_2d(x, w, None, 1, 1)
        y.grad = cupy.ones_like(y.array)
        y.backward()
        grads.append((y.array.get().tobytes(), x.grad.get().tobytes(), w.grad.get().tobytes()))
    assert grads[0] == grads[1]


BN = [(8, 16, 32, 32), (5, 32, 9, 7), (100, 64, 8, 8)]  # small m = 315: the unbiased running var


def _bn_link_pair(shape, rng):
    links = [cpu_kernels.BatchNormalization(shape[1]) for _ in range(2)]
    gamma, beta = (rng.standard_normal(shape[1]).astype(np.float32) for _ in range(2))
    mean = rng.standard_normal(shape[1]).astype(np.float32)
    var = rng.uniform(0.5, 2, shape[1]).astype(np.float32)
    for link in links:
        link.to_device("@cupy:0")
        link.gamma.array[...] = cupy.asarray(gamma)
        link.beta.array[...] = cupy.asarray(beta)
        link.avg_mean[...] = cupy.asarray(mean)
        link.avg_var[...] = cupy.asarray(var)
    return links


@pytest.mark.parametrize("shape", BN)
def test_batch_norm_training_matches_chainer(shape):
    rng = np.random.default_rng(2)
    ours, theirs = _bn_link_pair(shape, rng)
    x = _rand(rng, *shape, scale=2.0) + 0.5
    xv, xv_ref = chainer.Variable(x.copy()), chainer.Variable(x.copy())
    with chainer.using_config("train", True):
        y = ours(xv)
        with chainer.using_config("gpu_kernels", "chainer"):
            y_ref = theirs(xv_ref)
    assert isinstance(y.creator, gpu_kernels.functions.BatchNormalization), \
        f"cuDNN could not build BatchNorm for {shape}"
    _close(y.array, y_ref.array, rtol=5e-5, name="y")
    _close(ours.avg_mean, theirs.avg_mean, rtol=1e-5, name="avg_mean")
    _close(ours.avg_var, theirs.avg_var, rtol=1e-4, name="avg_var")
    gy = _rand(rng, *shape)
    y.grad, y_ref.grad = gy, gy.copy()
    ours.cleargrads(), theirs.cleargrads()
    y.backward()
    y_ref.backward()
    _close(xv.grad, xv_ref.grad, rtol=1e-4, name="gx")
    _close(ours.gamma.grad, theirs.gamma.grad, rtol=1e-4, name="ggamma")
    _close(ours.beta.grad, theirs.beta.grad, rtol=1e-4, name="gbeta")


@pytest.mark.parametrize("shape", BN[:2])
def test_batch_norm_inference_matches_chainer(shape):
    rng = np.random.default_rng(3)
    ours, theirs = _bn_link_pair(shape, rng)
    x = _rand(rng, *shape)
    executed = graphs.stats["executed"]
    with chainer.using_config("train", False), chainer.no_backprop_mode():
        y = ours(x)
        if graphs.stats["executed"] == executed:
            # cuDNN 9.19 on an H200 offered no deterministic strict-FP32 engine for inference
            # BatchNorm ("No valid engine configs for Norm_Fwd_", both layouts): then Chainer's
            # function runs it, and the key says why
            reasons = [why for key, why in graphs.errors.items() if "bn_inference" in key]
            assert reasons and all("NotSupported" in why for why in reasons), dict(graphs.errors)
        with chainer.using_config("gpu_kernels", "chainer"):
            y_ref = theirs(x)
    _close(y.array, y_ref.array, rtol=2e-5, name="y")


@pytest.mark.parametrize("model", ["resnet20", "cifar10-2015"])
def test_model_step_with_cudnn_matches_chainers_functions(model):
    from pipeline.backends.chainer.models import build_model
    from pipeline.core.rng import rng_for
    rng = np.random.default_rng(4)
    x = _rand(rng, 16, 3, 32, 32)
    t = cupy.asarray(rng.integers(0, 10, 16).astype(np.int32))
    results = []
    for kernels in ("cudnn", "chainer"):
        link = build_model(model, 10, seed=0)
        link.to_device("@cupy:0")
        with chainer.using_config("train", True), chainer.using_config("gpu_kernels", kernels):
            loss = F.softmax_cross_entropy(link(x, rng=rng_for(0, "dropout", 0, 0)), t)
            link.cleargrads()
            loss.backward()
        results.append((float(loss.array), {n: p.grad.get() for n, p in link.namedparams()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-4)
    num = sum(np.linalg.norm(grads_a[k] - grads_b[k]) ** 2 for k in grads_a) ** 0.5
    den = sum(np.linalg.norm(grads_b[k]) ** 2 for k in grads_b) ** 0.5
    # BatchNorm over 16 images amplifies rounding: one backward pass of resnet20 on GPU and CPU
    # agrees to 2e-3 (test_gpu.py); a wrong kernel is an O(1) difference
    assert num <= 2e-3 * den, num / den


def _optimizer_pair(name, decay):
    from pipeline.backends.chainer.models import build_model
    pair = []
    for _ in range(2):
        link = build_model("resnet20", 10, seed=0)
        link.to_device("@cupy:0")
        opt = setup_optimizer(make_optimizer(name, 0.05 if name == "momentum" else 1e-3,
                                             weight_decay=decay), link)
        pair.append((link, opt))
    return pair


@pytest.mark.parametrize("name,decay", [("momentum", 0.0), ("momentum", 5e-4), ("adam", 0.0),
                                        ("adam", 5e-4)])
def test_fused_update_is_chainers_update_bit_for_bit(name, decay, monkeypatch):
    monkeypatch.setenv("PIPELINE_FUSED_UPDATE", "1")
    (link_a, opt_a), (link_b, opt_b) = _optimizer_pair(name, decay)
    rng = np.random.default_rng(5)
    for step in range(3):
        for (_, pa), (_, pb) in zip(link_a.namedparams(), link_b.namedparams()):
            g = _rand(rng, *pa.shape, scale=0.1)
            pa.grad, pb.grad = g, g.copy()
        assert fused_update.update(opt_a) is True
        opt_b.update()
    for (n, pa), (_, pb) in zip(link_a.namedparams(), link_b.namedparams()):
        assert pa.array.get().tobytes() == pb.array.get().tobytes(), n
        for slot in pa.update_rule.state:
            assert (pa.update_rule.state[slot].get().tobytes()
                    == pb.update_rule.state[slot].get().tobytes()), (n, slot)
        assert pa.update_rule.t == pb.update_rule.t == 3
    assert opt_a.t == opt_b.t == 3


def test_fused_update_in_the_train_task_gives_the_same_bits(monkeypatch):
    """tasks.train on the GPU with and without the fused update: identical parameters and state."""
    from pipeline.data.cifar import synthetic_batch
    from pipeline.data.readers import Shard
    from pipeline.training import tasks
    params = tasks.init_params("resnet20", 10, seed=0)
    images, labels = synthetic_batch(0, "train", 0, 32)
    spec = tasks.StepSpec("resnet20", 10, "adam", 0.9, 5e-4, (1e-3,) * 2, 16, "steps", 0, 0, 0,
                          "@cupy:0")
    out = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PIPELINE_FUSED_UPDATE", fused)
        out[fused] = tasks.train(params, None, Shard(images, labels), spec)
    for k in out["1"].params:
        assert out["1"].params[k].tobytes() == out["0"].params[k].tobytes(), k
    for k in out["1"].opt:
        assert out["1"].opt[k].tobytes() == out["0"].opt[k].tobytes(), k
