"""The CPU-side parts of the cuDNN kernels and the fused update: choice per array, graph keys, the fallback without the frontend.

The GPU parts (results against Chainer's functions and update rules) are in test_gpu_cudnn.py.
"""
from __future__ import annotations

import logging
import pickle
import sys

import numpy as np
import pytest

from pipeline.backends.chainer import gpu_kernels
from pipeline.backends.chainer.compat import chainer
from pipeline.backends.chainer.gpu_kernels import functions, fused_update, graphs
from pipeline.backends.chainer.state import make_optimizer, setup_optimizer


class FakeCupyArray:
    """Looks like a CuPy ndarray to ``is_cupy`` (type name and module), nothing more."""

    def __init__(self, dtype=np.float32, shape=(2, 3, 8, 8)):
        self.dtype, self.shape, self.ndim = np.dtype(dtype), shape, len(shape)


FakeCupyArray.__name__ = "ndarray"
FakeCupyArray.__module__ = "cupy._core.core"


@pytest.fixture
def no_frontend(monkeypatch):
    """A process where ``import cudnn`` fails (CuPy reports CUDA 13)."""
    monkeypatch.setitem(sys.modules, "cudnn", None)
    monkeypatch.setattr(graphs, "_cuda_major", lambda: 13)
    graphs._reset_for_tests()
    yield
    graphs._reset_for_tests()


def test_kernels_are_chosen_on_float32_cupy_arrays_only(monkeypatch):
    monkeypatch.delenv("PIPELINE_GPU_KERNELS", raising=False)
    assert gpu_kernels.wanted(FakeCupyArray())
    assert not gpu_kernels.wanted(FakeCupyArray(np.float16))
    assert not gpu_kernels.wanted(np.zeros((2, 3, 8, 8), np.float32))
    assert not gpu_kernels.wanted(chainer.Variable(np.zeros((2, 3), np.float32)))
    with chainer.using_config("gpu_kernels", "chainer"):
        assert not gpu_kernels.wanted(FakeCupyArray())
    monkeypatch.setenv("PIPELINE_GPU_KERNELS", "chainer")
    assert not gpu_kernels.wanted(FakeCupyArray())
    with chainer.using_config("gpu_kernels", "cudnn"):  # the task's config beats the default
        assert gpu_kernels.wanted(FakeCupyArray())
    monkeypatch.setenv("PIPELINE_GPU_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PIPELINE_GPU_KERNELS"):
        gpu_kernels.default_choice()


def test_graph_keys_tell_apart_what_changes_the_graph():
    base = dict(x_shape=(8, 16, 32, 32), w_shape=(32, 16, 3, 3), stride=(1, 1), pad=(1, 1),
                dtype="float32", tf32=False)
    key = graphs.conv_key("fprop", **base)
    assert key == graphs.conv_key("fprop", **{**base, "x_shape": [8, 16, 32, 32]})
    assert hash(key) == hash(graphs.conv_key("fprop", **base))
    for change in (dict(x_shape=(9, 16, 32, 32)), dict(w_shape=(32, 16, 1, 1)),
                   dict(stride=(2, 2)), dict(pad=(0, 0)), dict(dtype="float16"), dict(tf32=True)):
        assert graphs.conv_key("fprop", **{**base, **change}) != key, change
    kinds = {graphs.conv_key(k, **base) for k in ("fprop", "dgrad", "wgrad")}
    assert len(kinds) == 3
    assert [k.op for k in functions.conv_keys((8, 16, 32, 32), (32, 16, 3, 3), 1, 1, "float32",
                                              False, backward=False)] == ["conv_fprop"]
    bn = graphs.bn_key("train", (8, 16, 32, 32), "float32")
    assert bn != graphs.bn_key("backward", (8, 16, 32, 32), "float32")
    assert bn != graphs.bn_key("train", (8, 16, 32, 32), "float32", "nhwc")
    assert pickle.loads(pickle.dumps(key)) == key
    with pytest.raises(ValueError, match="fprop, dgrad or wgrad"):
        graphs.conv_key("forward", **base)
    with pytest.raises(ValueError, match="layout"):
        graphs.bn_key("train", (8, 16, 32, 32), "float32", "nchwc")


@pytest.mark.parametrize("size,k,stride,pad", [(32, 3, 1, 1), (32, 3, 2, 1), (16, 1, 2, 0),
                                               (9, 5, 1, 2), (11, 3, 2, 0)])
def test_output_size_is_chainers(size, k, stride, pad):
    from chainer.utils import conv
    assert graphs.out_hw(size, k, stride, pad) == conv.get_conv_outsize(size, k, stride, pad)


def test_strides_describe_the_arrays():
    x = np.zeros((2, 3, 4, 5), np.float32)
    assert graphs.nchw_strides(x.shape) == [s // 4 for s in x.strides]
    nhwc = np.zeros((2, 4, 5, 3), np.float32).transpose(0, 3, 1, 2)
    assert graphs.nhwc_strides(nhwc.shape) == [s // 4 for s in nhwc.strides]


def test_tf32_follows_cupys_switch(monkeypatch):
    monkeypatch.delenv("CUPY_TF32", raising=False)
    assert not graphs.tf32_allowed()
    monkeypatch.setenv("CUPY_TF32", "1")
    assert graphs.tf32_allowed()


def test_without_the_frontend_one_log_line_and_chainers_functions(no_frontend, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.gpu_kernels"):
        assert graphs.load() is None
        assert graphs.load() is None  # tried once per process
        assert not gpu_kernels.use_cudnn(FakeCupyArray())
        assert graphs.get(graphs.conv_key("fprop", (1, 3, 8, 8), (4, 3, 3, 3), (1, 1), (1, 1),
                                          "float32", False)) is None
    lines = [r for r in caplog.records if r.name == "pipeline.gpu_kernels"]
    assert len(lines) == 1 and "Chainer's functions" in lines[0].getMessage()
    assert graphs.unavailable_reason().startswith("ModuleNotFoundError")


def test_an_unbuildable_key_is_remembered_and_logged_once(monkeypatch, caplog):
    """A key cuDNN refuses falls back for good: one line, no second build attempt."""
    attempts = []

    def refuse(cudnn, key):
        attempts.append(key)
        raise RuntimeError("cudnnGraphNotSupportedError: no engine")

    graphs._reset_for_tests(module=object(), tried=True)
    monkeypatch.setattr(graphs, "_build_conv", refuse)
    key = graphs.conv_key("wgrad", (1, 3, 8, 8), (4, 3, 3, 3), (1, 1), (1, 1), "float32", False)
    try:
        with caplog.at_level(logging.WARNING, logger="pipeline.gpu_kernels"):
            assert graphs.get(key) is None
            assert graphs.get(key) is None
        assert attempts == [key]
        assert len([r for r in caplog.records if "cannot run" in r.getMessage()]) == 1
        assert key in [k for k, _ in graphs.cached_keys()]
        assert not functions.conv_ready((1, 3, 8, 8), (4, 3, 3, 3), 1, 1, "float32", True)
    finally:
        graphs._reset_for_tests()


def test_links_on_numpy_never_ask_for_cudnn(monkeypatch):
    from pipeline.backends.chainer import cpu_kernels
    monkeypatch.setattr(graphs, "load", lambda: pytest.fail("cuDNN asked for a NumPy array"))
    link = cpu_kernels.Convolution2D(3, 4, 3, pad=1)
    bn = cpu_kernels.BatchNormalization(4)
    with chainer.using_config("train", True):
        y = bn(link(np.ones((2, 3, 8, 8), np.float32)))
    assert y.shape == (2, 4, 8, 8)


def _momentum_model(decay):
    from pipeline.backends.chainer.models import build_model
    model = build_model("small-cnn", seed=0)
    opt = setup_optimizer(make_optimizer("momentum", 0.05, weight_decay=decay), model)
    for p in model.params():
        p.grad = np.full_like(p.array, 0.01)
    return model, opt


@pytest.mark.parametrize("decay", [0.0, 5e-4])
def test_fused_update_on_numpy_is_chainers_update(decay):
    model_a, opt_a = _momentum_model(decay)
    model_b, opt_b = _momentum_model(decay)
    before = dict(fused_update.stats)
    assert fused_update.update(opt_a) is False
    opt_b.update()
    assert fused_update.stats["fallback"] == before["fallback"] + 1
    for (name, a), (_, b) in zip(model_a.namedparams(), model_b.namedparams()):
        assert a.array.tobytes() == b.array.tobytes(), name
    assert opt_a.t == opt_b.t == 1


def test_fused_plan_rules():
    model, opt = _momentum_model(5e-4)
    assert fused_update._kind(opt) == "momentum"
    assert fused_update._decay_rate(opt) == 5e-4
    assert fused_update.plan(opt) is None  # NumPy parameters
    adam = make_optimizer("adam", 1e-3)
    assert fused_update._kind(adam) == "adam"
    assert fused_update._kind(make_optimizer("sgd", 0.1)) is None
    amsgrad = chainer.optimizers.Adam(amsgrad=True)
    assert fused_update._kind(amsgrad) is None
    opt.add_hook(chainer.optimizer_hooks.GradientClipping(1.0))
    assert fused_update._decay_rate(opt) is None


def test_fused_kernels_hold_chainers_arithmetic():
    """The bodies are Chainer 7.8.1's own kernel text (the bits depend on it)."""
    import inspect

    from chainer.optimizers import adam, momentum_sgd
    for line in fused_update._MOMENTUM.splitlines():
        assert line.strip() in inspect.getsource(momentum_sgd.MomentumSGDRule.update_core_gpu)
    adam_source = inspect.getsource(adam.AdamRule.update_core_gpu)
    for line in fused_update._ADAM.splitlines():
        line = line.strip().replace("static_cast<T>(m_)", "static_cast<P>(m_)")
        line = line.replace("static_cast<T>(v_);", "static_cast<P>(v_);")
        assert line.split("(")[0] in adam_source, line
    assert "param -= eta * (alpha_t * m_ / (sqrt(v_) + eps) +" in adam_source


def _numpy_kernel(kind, decay):
    """The fused kernel in NumPy: the same tables of pointers (host addresses here), float32."""
    import ctypes

    def at(address, n):
        return np.ctypeslib.as_array((ctypes.c_float * n).from_address(int(address)))

    def run(grad_ptrs, cum, *args, size):
        n_scalars = len(fused_update.SPECS[kind][0]) + bool(decay)
        f32 = [np.float32(a) for a in args[:n_scalars]]
        *slot_tables, param_ptrs = args[n_scalars:]
        assert size == cum[-1]
        for j in range(len(cum) - 1):
            n = int(cum[j + 1] - cum[j])
            grad, param = at(grad_ptrs[j], n).copy(), at(param_ptrs[j], n)
            slots = [at(table[j], n) for table in slot_tables]
            scalars = list(f32)
            if decay:
                grad += scalars.pop(0) * param
            if kind == "momentum":
                lr, momentum = scalars
                (v,) = slots
                v *= momentum
                v -= lr * grad
                param += v
            else:
                alpha_t, omb1, omb2, eps, eta, wdr = scalars
                m, v = slots
                m += omb1 * (grad - m)
                v += omb2 * (grad * grad - v)
                param -= eta * (alpha_t * m / (np.sqrt(v) + eps) + wdr * param)
    return run


@pytest.mark.parametrize("name,decay", [("momentum", 5e-4), ("adam", 0.0), ("adam", 5e-4)])
def test_fused_update_plumbing_on_flat_views(name, decay, monkeypatch):
    """Pointer tables, slots, step counts and scalars, with NumPy standing in for CuPy."""
    import types

    from pipeline.backends.chainer.models import build_model
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        asarray=np.asarray, ascontiguousarray=np.ascontiguousarray))
    monkeypatch.setattr(gpu_kernels, "is_cupy", lambda a: isinstance(a, np.ndarray))
    monkeypatch.setattr(fused_update, "_kernel", _numpy_kernel)
    monkeypatch.setenv("PIPELINE_FUSED_UPDATE", "1")
    pairs = []
    for _ in range(2):
        link = build_model("small-cnn", seed=0)
        pairs.append((link, setup_optimizer(make_optimizer(name, 0.05 if name == "momentum"
                                                           else 1e-3, weight_decay=decay), link)))
    (link_a, opt_a), (link_b, opt_b) = pairs
    rng = np.random.default_rng(0)
    tables = set()
    for step in range(3):
        for pa, pb in zip(link_a.params(), link_b.params()):
            g = (rng.standard_normal(pa.shape) * 0.1).astype(np.float32)
            pa.grad, pb.grad = g, g.copy()
        assert fused_update.update(opt_a) is True
        opt_b.update()
        tables.add(id(opt_a._pipeline_tables))
    assert len(tables) == 1  # built once, reused every step
    for (n, pa), (_, pb) in zip(link_a.namedparams(), link_b.namedparams()):
        np.testing.assert_allclose(pa.array, pb.array, rtol=1e-6, atol=1e-7, err_msg=n)
        for slot in pb.update_rule.state:
            np.testing.assert_allclose(pa.update_rule.state[slot], pb.update_rule.state[slot],
                                       rtol=1e-5, atol=1e-8, err_msg=f"{n}/{slot}")
        assert pa.update_rule.t == pb.update_rule.t == 3
    assert opt_a.t == opt_b.t == 3
    # the serialized state (what crosses task boundaries) is the same shape and keys
    from pipeline.backends.chainer.state import get_optimizer_state, get_state
    assert list(get_optimizer_state(opt_a)) == list(get_optimizer_state(opt_b))
    assert list(get_state(link_a)) == list(get_state(link_b))
    next(link_a.params()).grad = None  # a missing gradient: Chainer's update (it uses zeros)
    assert fused_update.update(opt_a) is False


# --- the cuDNN FunctionNodes' plumbing, with NumPy for CuPy and Chainer's CPU functions for cuDNN
def _fake_graph_execute(built, pointers):
    """What each cuDNN graph computes, from Chainer's CPU functions (linear ops) or formulas (BN)."""
    from chainer import functions as CF
    key, params = built
    p = pointers
    if key.op == "conv_fprop":
        p["out"][...] = CF.convolution_2d(p["x"], p["w"], None, key.stride, key.pad).array
    elif key.op == "conv_dgrad":
        p["out"][...] = CF.deconvolution_2d(p["dy"], p["w"], None, key.stride, key.pad,
                                            outsize=key.x[2:]).array
    elif key.op == "conv_wgrad":
        w = chainer.Variable(np.zeros(key.w, np.float32))
        with chainer.using_config("enable_backprop", True):  # we are inside a backward pass
            y = CF.convolution_2d(p["x"], w, None, key.stride, key.pad)
            y.grad = p["dy"]
            y.backward()
        p["out"][...] = w.grad
    else:
        x = p["x"].astype(np.float64)
        m = x.size // x.shape[1]
        c = (None, slice(None), None, None)
        if key.op == "bn_train":
            mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
            inv_std = 1 / np.sqrt(var + params["eps"])
            p["y"][...] = p["gamma"][c] * (x - mean[c]) * inv_std[c] + p["beta"][c]
            p["saved_mean"][...], p["saved_inv_std"][...] = mean, inv_std
            momentum = 1 - params["decay"]
            p["next_mean"][...] = (1 - momentum) * p["mean"] + momentum * mean
            p["next_var"][...] = (1 - momentum) * p["var"] + momentum * var * m / max(m - 1, 1)
        elif key.op == "bn_backward":
            dy = p["dy"].astype(np.float64)
            xhat = (x - p["saved_mean"][c]) * p["saved_inv_std"][c]
            dgamma, dbeta = (dy * xhat).sum(axis=(0, 2, 3)), dy.sum(axis=(0, 2, 3))
            p["dgamma"][...], p["dbeta"][...] = dgamma, dbeta
            p["dx"][...] = (p["gamma"] * p["saved_inv_std"] / m)[c] * (
                m * dy - dbeta[c] - xhat * dgamma[c])
        else:
            p["y"][...] = p["gamma"][c] * (x - p["mean"][c]) * p["inv_std"][c] + p["beta"][c]


@pytest.fixture
def numpy_for_cupy(monkeypatch):
    """The cuDNN nodes run on NumPy arrays (forward_cpu = forward_gpu) with fake graphs."""
    import types
    fake = types.SimpleNamespace(
        empty=np.empty, zeros=np.zeros, ones=np.ones, ascontiguousarray=np.ascontiguousarray,
        float32=np.float32, reciprocal=np.reciprocal, sqrt=np.sqrt)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for node in (functions.Convolution2D, functions.BatchNormalization,
                 functions.FixedBatchNormalization):
        monkeypatch.setattr(node, "forward_cpu", node.forward_gpu, raising=False)
    monkeypatch.setattr(graphs, "execute", _fake_graph_execute)
    layouts = {"nchw"}

    def get(key, **params):
        return (key, params) if key.layout in layouts else None

    monkeypatch.setattr(graphs, "get", get)
    return layouts


@pytest.mark.parametrize("xs,ws,stride,pad,bias", [
    ((2, 3, 9, 11), (4, 3, 3), 1, 1, True), ((3, 4, 8, 8), (6, 1, 1), 2, 0, False),
    ((2, 5, 7, 6), (3, 3, 2), (2, 1), (1, 0), True)])
def test_conv_node_plumbing(numpy_for_cupy, xs, ws, stride, pad, bias):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(xs).astype(np.float32)
    w = rng.standard_normal((ws[0], xs[1], ws[1], ws[2])).astype(np.float32)
    b = rng.standard_normal(ws[0]).astype(np.float32) if bias else None
    ours = [chainer.Variable(a.copy()) for a in (x, w, b) if a is not None]
    theirs = [chainer.Variable(a.copy()) for a in (x, w, b) if a is not None]
    y = gpu_kernels.convolution_2d(*ours[:2], ours[2] if bias else None, stride, pad)
    y_ref = chainer.functions.convolution_2d(*theirs[:2], theirs[2] if bias else None, stride,
                                             pad)
    np.testing.assert_allclose(y.array, y_ref.array, rtol=1e-5, atol=1e-5)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    y.grad, y_ref.grad = gy, gy.copy()
    y.backward()
    y_ref.backward()
    for a, e in zip(ours, theirs):
        np.testing.assert_allclose(a.grad, e.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (6, 2, 1, 1)])
def test_batch_norm_node_plumbing(numpy_for_cupy, layout, shape):
    numpy_for_cupy.clear()
    numpy_for_cupy.add(layout)  # only this layout "builds": nhwc goes through the transposes
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    gamma, beta = (rng.standard_normal(shape[1]).astype(np.float32) for _ in range(2))
    mean0 = rng.standard_normal(shape[1]).astype(np.float32)
    var0 = rng.uniform(0.5, 2, shape[1]).astype(np.float32)
    ours = [chainer.Variable(a.copy()) for a in (x, gamma, beta)]
    theirs = [chainer.Variable(a.copy()) for a in (x, gamma, beta)]
    rm, rv, rm_ref, rv_ref = mean0.copy(), var0.copy(), mean0.copy(), var0.copy()
    with chainer.using_config("train", True):
        y = gpu_kernels.batch_normalization(*ours, 2e-5, rm, rv, 0.9)
        y_ref = chainer.functions.batch_normalization(*theirs, eps=2e-5, running_mean=rm_ref,
                                                      running_var=rv_ref, decay=0.9)
    assert y.creator.layout == layout and y.shape == shape
    np.testing.assert_allclose(y.array, y_ref.array, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rm, rm_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rv, rv_ref, rtol=1e-5, atol=1e-6)
    gy = rng.standard_normal(shape).astype(np.float32)
    y.grad, y_ref.grad = gy, gy.copy()
    y.backward()
    y_ref.backward()
    for a, e in zip(ours, theirs):
        np.testing.assert_allclose(a.grad, e.grad, rtol=1e-3, atol=1e-4)
    with chainer.using_config("train", False), chainer.no_backprop_mode():
        y = gpu_kernels.fixed_batch_normalization(x, gamma, beta, mean0, var0, 2e-5)
        y_ref = chainer.functions.fixed_batch_normalization(x, gamma, beta, mean0, var0, 2e-5)
    np.testing.assert_allclose(y.array, y_ref.array, rtol=1e-5, atol=1e-5)


def test_a_graph_that_builds_but_fails_its_trial_run_is_left_to_chainer(monkeypatch, caplog):
    def trial(built, key):
        raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED")

    graphs._reset_for_tests(module=object(), tried=True)
    monkeypatch.setattr(graphs, "_build_conv", lambda cudnn, key: graphs.Built(None, {}, 0, {}))
    monkeypatch.setattr(graphs, "_smoke", trial)
    key = graphs.conv_key("fprop", (1, 3, 8, 8), (4, 3, 3, 3), (1, 1), (1, 1), "float32", False)
    try:
        with caplog.at_level(logging.WARNING, logger="pipeline.gpu_kernels"):
            assert graphs.get(key) is None
        assert "EXECUTION_FAILED" in graphs.errors[str(key)]
        assert graphs.stats["unsupported"] == 1 and graphs.stats["built"] == 0
    finally:
        graphs._reset_for_tests()
