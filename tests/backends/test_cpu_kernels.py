"""Our NumPy convolution, pooling and BatchNorm against Chainer's: values, gradients, ties, models."""
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pipeline.backends.chainer import cpu_kernels
from pipeline.backends.chainer.compat import F, chainer, gradient_check
from pipeline.backends.chainer.cpu_kernels import functions as K
from pipeline.backends.chainer.models import MODELS, build_model
from pipeline.data.readers import Shard

# Chainer's functions are the reference here, not our dispatchers
pytestmark = pytest.mark.usefixtures("chainers_own_functions")
EXAMPLES = settings(max_examples=60, deadline=None, derandomize=True, database=None)


def _rng(seed):
    return np.random.default_rng(seed)


def _grads(fn, inputs, gy):
    """fn(*Variables) -> (output array, gradients of every input) for the upstream gradient gy."""
    vs = [chainer.Variable(a.copy()) for a in inputs]
    y = fn(*vs)
    y.grad = gy
    y.backward()
    return y.array, [v.grad for v in vs]


def _assert_same(fn_ours, fn_theirs, inputs, seed, exact=False):
    """Same output (bit for bit if ``exact``) and same gradients up to summation order."""
    y_ref = fn_theirs(*inputs)
    gy = _rng(seed).standard_normal(y_ref.shape)
    y0, g0 = _grads(fn_theirs, inputs, gy)
    y1, g1 = _grads(fn_ours, inputs, gy)
    assert y1.shape == y0.shape
    if exact:
        np.testing.assert_array_equal(y1, y0)
    else:
        np.testing.assert_allclose(y1, y0, rtol=1e-10, atol=1e-10)
    for a, b in zip(g1, g0):  # a gradient routed to the wrong tied input is off by O(1)
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


# ---- convolution ---------------------------------------------------------------------------

conv_cases = st.tuples(
    st.integers(1, 3), st.integers(1, 4), st.integers(1, 9), st.integers(1, 9),  # N, C, H, W
    st.integers(1, 4), st.integers(1, 4), st.integers(1, 4),  # O, kh, kw
    st.integers(1, 3), st.integers(1, 3), st.integers(0, 4), st.integers(0, 4),  # sy, sx, ph, pw
    st.booleans(), st.integers(0, 2**16))


@EXAMPLES
@given(conv_cases)
def test_convolution_matches_chainer(case):
    n, c, h, w, o, kh, kw, sy, sx, ph, pw, bias, seed = case
    if h + 2 * ph < kh or w + 2 * pw < kw:
        return  # no output pixel: Chainer refuses too
    r = _rng(seed)
    inputs = [r.standard_normal((n, c, h, w)), r.standard_normal((o, c, kh, kw))]
    if bias:
        inputs.append(r.standard_normal(o))
    _assert_same(lambda *a: K.convolution_2d(*a, stride=(sy, sx), pad=(ph, pw)),
                 lambda *a: F.convolution_2d(*a, stride=(sy, sx), pad=(ph, pw)), inputs, seed)


@EXAMPLES
@given(conv_cases)
def test_im2col_pads_in_place_with_the_columns_of_a_padded_copy(case):
    """The columns read from x as if padded are those of x copied into a padded array first."""
    from pipeline.backends.chainer.cpu_kernels import convolution, layout
    n, c, h, w, _, kh, kw, sy, sx, ph, pw, ones, seed = case
    ho, wo = layout.out_size(h, kh, sy, ph), layout.out_size(w, kw, sx, pw)
    if ho < 1 or wo < 1:
        return
    x = _rng(seed).standard_normal((n, h, w, c)).astype(np.float32)
    xp = layout.pad_nhwc(x, ph, pw, max(ph, (ho - 1) * sy + kh - h - ph),
                         max(pw, (wo - 1) * sx + kw - w - pw))
    ranges = [(i, i + 1) for i in range(n)]
    got = [col.copy() for *_, col in convolution._columns(x, kh, kw, sy, sx, ho, wo, (ph, pw),
                                                          ones, ranges)]
    want = [col.copy() for *_, col in convolution._columns(xp, kh, kw, sy, sx, ho, wo, (0, 0),
                                                           ones, ranges)]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("stride,pad,bias", [(1, 1, True), (2, 1, False), (1, 0, True),
                                             (3, 2, True)])
def test_convolution_check_backward(stride, pad, bias):
    r = _rng(stride * 10 + pad)
    inputs = [r.standard_normal((2, 3, 7, 6)), r.standard_normal((4, 3, 3, 3))]
    if bias:
        inputs.append(r.standard_normal(4))
    fn = lambda *a: K.convolution_2d(*a, stride=stride, pad=pad)  # noqa: E731
    gy = r.standard_normal(fn(*inputs).shape)
    gradient_check.check_backward(fn, tuple(inputs), gy, dtype=np.float64, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("wanted", [(False, True, True), (True, False, True), (True, True, False),
                                    (False, False, True)])
def test_convolution_computes_the_gradients_asked_for(wanted):
    r = _rng(11)
    arrays = (r.standard_normal((2, 3, 5, 4)), r.standard_normal((4, 3, 3, 3)), r.standard_normal(4))
    gy = r.standard_normal((2, 4, 5, 4))
    grads = []
    for conv in (K.convolution_2d, F.convolution_2d):
        vs = [chainer.Variable(a.copy(), requires_grad=w) for a, w in zip(arrays, wanted)]
        y = conv(*vs, pad=1)
        y.grad = gy
        y.backward()
        grads.append([v.grad for v in vs])
    for ours, theirs, w in zip(*grads, wanted):
        assert (ours is None) == (not w)
        if w:
            np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-10)


def test_pointwise_convolution_with_stride_check_backward():
    r = _rng(7)
    fn = lambda x, W: K.convolution_2d(x, W, stride=2)  # noqa: E731 (resnet20's projection)
    inputs = (r.standard_normal((2, 3, 5, 6)), r.standard_normal((4, 3, 1, 1)))
    gradient_check.check_backward(fn, inputs, r.standard_normal((2, 4, 3, 3)), dtype=np.float64,
                                  atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape,w_shape,stride,pad,bias", [
    ((7, 3, 9, 8), (5, 3, 3, 3), 1, 1, True),    # stride 1: gx by the flipped kernel
    ((6, 4, 9, 9), (3, 4, 3, 3), 2, 1, False),   # stride 2: gx by col2im
    ((5, 2, 8, 7), (4, 2, 5, 5), 1, 2, True),    # cifar10-2015's 5x5
])
def test_convolution_threads_give_the_bits_of_one_thread(monkeypatch, shape, w_shape, stride, pad,
                                                         bias):
    """Chunks shared among threads: every GEMM and gW's chunk order as on one thread."""
    from threadpoolctl import threadpool_limits
    from pipeline.backends.chainer.cpu_kernels import convolution
    monkeypatch.setattr(convolution, "CHUNK_BYTES", 1)  # one image per chunk: 5-7 chunks
    r = _rng(3)
    arrays = [r.standard_normal(shape).astype(np.float32),
              r.standard_normal(w_shape).astype(np.float32)]
    if bias:
        arrays.append(r.standard_normal(w_shape[0]).astype(np.float32))
    results = []
    with threadpool_limits(1):
        for threads in (1, 2, 3):
            with chainer.using_config("cpu_kernel_threads", threads):
                y, grads = _grads(lambda *a: K.convolution_2d(*a, stride=stride, pad=pad), arrays,
                                  _rng(4).standard_normal(
                                      K.convolution_2d(*arrays, stride=stride, pad=pad).shape
                                  ).astype(np.float32))
            results.append([y] + grads)
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            assert a.tobytes() == b.tobytes()


def test_a_step_with_kernel_threads_gives_the_bits_of_one_thread(monkeypatch):
    from threadpoolctl import threadpool_limits
    from pipeline.backends.chainer.cpu_kernels import convolution
    monkeypatch.setattr(convolution, "CHUNK_BYTES", 64 << 10)  # several chunks at batch 8
    runs = []
    with threadpool_limits(1):
        for threads in (1, 2):
            with chainer.using_config("cpu_kernel_threads", threads):
                runs.append(_train("small-cnn", "ours"))
    assert runs[1][0] == runs[0][0]
    for path, value in runs[0][1].items():
        assert runs[1][1][path].tobytes() == value.tobytes(), path


# ---- pooling -------------------------------------------------------------------------------

pool_cases = st.tuples(
    st.integers(1, 3), st.integers(1, 3), st.integers(1, 9), st.integers(1, 9),  # N, C, H, W
    st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3),  # kh, kw, sy, sx
    st.integers(0, 3), st.integers(0, 3), st.booleans(), st.booleans(),  # ph, pw, cover_all, ties
    st.integers(0, 2**16))


def _pool_input(case):
    n, c, h, w, kh, kw, sy, sx, ph, pw, cover_all, ties, seed = case
    r = _rng(seed)
    if ties:  # few distinct values (as after ReLU on flat image regions): the tie rule shows
        return r.integers(-1, 3, (n, c, h, w)).astype(np.float64)
    return r.standard_normal((n, c, h, w))


@EXAMPLES
@given(pool_cases)
def test_max_pooling_matches_chainer_ties_included(case):
    n, c, h, w, kh, kw, sy, sx, ph, pw, cover_all, ties, seed = case
    if ph >= kh or pw >= kw or h + 2 * ph < kh or w + 2 * pw < kw:
        return  # windows of padding only (Chainer fills -inf), or no window at all
    args = dict(ksize=(kh, kw), stride=(sy, sx), pad=(ph, pw), cover_all=cover_all)
    _assert_same(lambda x: K.max_pooling_2d(x, **args),
                 lambda x: F.max_pooling_2d(x, **args), [_pool_input(case)], seed, exact=True)


@EXAMPLES
@given(pool_cases, st.integers(2, 3))
def test_max_pooling_on_threads_matches_chainer_ties_included(case, threads):
    """The batch cut into parts on their own threads: the same values and routed gradients."""
    n, c, h, w, kh, kw, sy, sx, ph, pw, cover_all, ties, seed = case
    if ph >= kh or pw >= kw or h + 2 * ph < kh or w + 2 * pw < kw:
        return
    args = dict(ksize=(kh, kw), stride=(sy, sx), pad=(ph, pw), cover_all=cover_all)
    with chainer.using_config("cpu_kernel_threads", threads):
        _assert_same(lambda x: K.max_pooling_2d(x, **args),
                     lambda x: F.max_pooling_2d(x, **args), [_pool_input(case)], seed, exact=True)


@EXAMPLES
@given(pool_cases, st.sampled_from([1, 2]), st.sampled_from([np.float32, np.float64]))
def test_compiled_max_pooling_passes_give_the_numpy_passes_bits(case, axis, dtype):
    """Values, offsets and routed gradients of each 1-D pass, signed zeros, NaN and -inf in
    the input included: the compiled loops (``pooling_compiled``) against the NumPy passes."""
    from pipeline.backends.chainer.cpu_kernels import pooling, pooling_compiled
    from pipeline.backends.chainer.cpu_kernels.layout import out_size
    if pooling_compiled.loops() is None:
        pytest.skip("Numba is not installed: the NumPy passes run")
    n, c, h, w, kh, kw, sy, sx, ph, pw, cover_all, ties, seed = case
    k, s, p, size = (kh, sy, ph, h) if axis == 1 else (kw, sx, pw, w)
    if p >= k or size + 2 * p < k:
        return
    r = _rng(seed)
    x = _pool_input(case).astype(dtype)
    x[r.random(x.shape) < 0.2] = -0.0
    x[r.random(x.shape) < 0.05] = r.choice([np.nan, -np.inf, np.inf])
    x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))  # channels-last, as our kernels hold it
    length = out_size(size, k, s, p, cover_all)
    runs = [pooling._max1d(x, axis, k, s, p, length, True, compiled=flag) for flag in (True, False)]
    gy = r.standard_normal(runs[0][0].shape).astype(dtype)
    grads = [pooling._max1d_grad(gy, arg, axis, size, k, s, p, compiled=flag)
             for (_, arg), flag in zip(runs, (True, False))]
    assert runs[0][0].tobytes() == runs[1][0].tobytes()
    assert runs[0][1].tobytes() == runs[1][1].tobytes()
    assert grads[0].tobytes() == grads[1].tobytes()


def test_adam_on_threads_gives_the_bits_of_one_thread(monkeypatch):
    """The update's slices shared among threads: each element sees the one-thread operations."""
    from pipeline.backends.chainer.cpu_kernels import optimizers, sharing
    monkeypatch.setattr(optimizers, "CHUNK", 1000)  # 11 slices
    monkeypatch.setattr(chainer.optimizers.adam.AdamRule, "update_core_cpu",
                        optimizers.adam_update_core_cpu)
    shares, run = [], sharing.run
    monkeypatch.setattr(sharing, "run", lambda fn, parts: shares.append(len(parts)) or run(fn, parts))
    r = _rng(9)
    start, grads = r.standard_normal(10_500).astype(np.float32), [
        r.standard_normal(10_500).astype(np.float32) for _ in range(3)]
    results = []
    for threads in (1, 2, 3):
        link = chainer.Link()
        with link.init_scope():
            link.w = chainer.Parameter(start.copy())
        opt = chainer.optimizers.Adam(alpha=1e-2, weight_decay_rate=1e-3)
        opt.setup(link)
        with chainer.using_config("cpu_kernel_threads", threads):
            for g in grads:
                link.w.grad = g.copy()
                opt.update()
        results.append(link.w.array.tobytes() + opt.target.w.update_rule.state["v"].tobytes())
    assert results[1] == results[0] and results[2] == results[0]
    assert sorted(set(shares)) == [1, 2, 3]


@EXAMPLES
@given(pool_cases)
def test_max_pooling_without_graph_matches_chainer(case):
    n, c, h, w, kh, kw, sy, sx, ph, pw, cover_all, ties, seed = case
    if ph >= kh or pw >= kw or h + 2 * ph < kh or w + 2 * pw < kw:
        return
    args = dict(ksize=(kh, kw), stride=(sy, sx), pad=(ph, pw), cover_all=cover_all)
    x = _pool_input(case)
    with chainer.no_backprop_mode():  # inference: no argmax is kept
        np.testing.assert_array_equal(K.max_pooling_2d(x, **args).array,
                                      F.max_pooling_2d(x, **args).array)


@EXAMPLES
@given(pool_cases)
def test_average_pooling_matches_chainer(case):
    n, c, h, w, kh, kw, sy, sx, ph, pw, _, _, seed = case
    if h + 2 * ph < kh or w + 2 * pw < kw:
        return
    args = dict(ksize=(kh, kw), stride=(sy, sx), pad=(ph, pw))
    _assert_same(lambda x: K.average_pooling_2d(x, **args),
                 lambda x: F.average_pooling_2d(x, **args), [_pool_input(case)], seed)


@pytest.mark.parametrize("shape", [(2, 3, 8, 8), (2, 2, 7, 9), (1, 2, 3, 5)])
@pytest.mark.parametrize("ties", [False, True])
def test_spatial_pyramid_pooling_matches_chainer(shape, ties):
    r = _rng(sum(shape))
    x = r.integers(0, 3, shape).astype(np.float64) if ties else r.standard_normal(shape)
    _assert_same(lambda v: K.spatial_pyramid_pooling_2d(v, 3),
                 lambda v: F.spatial_pyramid_pooling_2d(v, 3, pooling="max"), [x], 1, exact=True)


@pytest.mark.parametrize("fn", [
    lambda x: K.max_pooling_2d(x, 3, stride=2, pad=1),
    lambda x: K.max_pooling_2d(x, 2),
    lambda x: K.average_pooling_2d(x, 3, stride=2, pad=1),
    lambda x: K.spatial_pyramid_pooling_2d(x, 3),
], ids=["max3s2p1", "max2", "avg3s2p1", "spp3"])
def test_pooling_check_backward(fn):
    # distinct values, far apart, so the max is unambiguous under the finite difference
    x = _rng(3).permutation(2 * 3 * 8 * 8).reshape(2, 3, 8, 8) / 10.0
    gy = _rng(4).standard_normal(fn(x).shape)
    gradient_check.check_backward(fn, (x,), gy, dtype=np.float64, atol=1e-5, rtol=1e-5)


# ---- layouts and dispatch ------------------------------------------------------------------

def test_outputs_are_channels_last_views_and_any_input_layout_works():
    r = _rng(5)
    x = r.standard_normal((2, 3, 10, 12)).astype(np.float32)
    W = r.standard_normal((4, 3, 3, 3)).astype(np.float32)
    y = K.convolution_2d(x, W, pad=1).array
    assert y.shape == (2, 4, 10, 12) and y.transpose(0, 2, 3, 1).flags.c_contiguous
    odd = x[:, :, ::2, 1:]  # neither NCHW- nor NHWC-contiguous
    np.testing.assert_allclose(K.convolution_2d(odd, W, pad=1).array,
                               F.convolution_2d(odd, W, pad=1).array, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(K.max_pooling_2d(y, 3, 2).array, F.max_pooling_2d(y, 3, 2).array)


def test_config_switch_picks_the_kernels():
    model = build_model("small-cnn", seed=0)
    x = np.zeros((1, 3, 32, 32), np.float32)
    assert isinstance(model.conv1(x).creator, K.Convolution2D)  # ours by default
    with chainer.using_config("cpu_kernels", "chainer"):
        assert not isinstance(model.conv1(x).creator, K.Convolution2D)
        assert not isinstance(cpu_kernels.max_pooling_2d(x, 2).creator, K.MaxPooling2D)
    assert isinstance(cpu_kernels.max_pooling_2d(x, 2).creator, K.MaxPooling2D)


def test_double_backprop_is_refused_with_a_reason():
    x = chainer.Variable(_rng(0).standard_normal((1, 1, 4, 4)))
    y = F.sum(K.max_pooling_2d(x, 2) ** 2)
    with pytest.raises(NotImplementedError, match="double backprop"):
        chainer.grad([y], [x], enable_double_backprop=True)


def test_bad_shapes_fail_chainer_type_check():
    with pytest.raises(chainer.utils.type_check.InvalidType):
        K.convolution_2d(np.zeros((1, 3, 5, 5), np.float32), np.zeros((2, 4, 3, 3), np.float32))


# ---- models --------------------------------------------------------------------------------

def _cast(model, dtype):
    """All float parameters and statistics of ``model`` to ``dtype``."""
    for link in model.links():
        for name in list(link._params) + list(link._persistent):
            value = getattr(link, name)
            if isinstance(value, chainer.Parameter):
                value.array = value.array.astype(dtype)
            elif isinstance(value, np.ndarray) and value.dtype.kind == "f":
                setattr(link, name, value.astype(dtype))
    return model


def _train(name, kernels, dtype=np.float32, steps=3, batch=8):
    """A few momentum-SGD steps from seeded weights and data; -> (losses, final parameters).

    Not Adam: its step is m / sqrt(v), which turns a last-bit difference in a near-zero gradient
    into a full step of either sign.
    """
    model = _cast(build_model(name, seed=0), dtype)
    opt = chainer.optimizers.MomentumSGD(lr=0.01)
    opt.setup(model)
    r = _rng(1)
    losses = []
    with chainer.using_config("train", True), chainer.using_config("cpu_kernels", kernels):
        for step in range(steps):
            x = r.standard_normal((batch, 3, 32, 32)).astype(dtype)
            t = r.integers(0, 10, batch).astype(np.int32)
            loss = F.softmax_cross_entropy(model(x, rng=np.random.default_rng(step)), t)
            model.cleargrads()
            loss.backward()
            opt.update()
            losses.append(float(loss.array))
    state = {path: p.array.copy() for path, p in model.namedparams()}
    state.update({f"{path}/avg_mean": link.avg_mean.copy() for path, link in model.namedlinks()
                  if getattr(link, "avg_mean", None) is not None})
    return losses, state


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "resnet20" else n
                                  for n in sorted(MODELS)])
def test_training_with_ours_matches_chainer_float64(name):
    loss_c, params_c = _train(name, "chainer", np.float64)
    loss_o, params_o = _train(name, "ours", np.float64)
    np.testing.assert_allclose(loss_o, loss_c, rtol=1e-10)
    for path in params_c:  # BatchNorm running means included
        np.testing.assert_allclose(params_o[path], params_c[path], rtol=1e-8, atol=1e-11,
                                   err_msg=path)


# Not resnet20: its BatchNorm gradients cancel, so after 3 float32 steps Chainer itself is ~5% of
# an update away from float64 here, and so are we (the float64 test above is its check).
@pytest.mark.parametrize("name", ["cifar10-2015", "small-cnn"])
def test_training_with_ours_matches_chainer_float32(name):
    loss_c, params_c = _train(name, "chainer")
    loss_o, params_o = _train(name, "ours")
    np.testing.assert_allclose(loss_o, loss_c, rtol=1e-5)
    for path in params_c:  # float32 sums in another order: a few ulps per step
        np.testing.assert_allclose(params_o[path], params_c[path], rtol=1e-4, atol=1e-6,
                                   err_msg=path)


# ---- the switch from the command line to the task ------------------------------------------

def test_cli_flag_reaches_the_config_and_bad_values_are_one_line(capsys, tmp_path):
    from pipeline.cli.parser import build_parser, main
    from pipeline.cli.commands import config_from_args
    args = build_parser().parse_args(["train", "--cpu-kernels", "chainer"])
    assert config_from_args(args).model.cpu_kernels == "chainer"
    assert config_from_args(build_parser().parse_args(["train"])).model.cpu_kernels == "ours"
    assert main(["train", "--cpu-kernels", "mkl", "--no-progress", "--out",
                 str(tmp_path / "run")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "model.cpu_kernels" in errors[0]


@pytest.mark.parametrize("kernels", ["ours", "chainer"])
def test_train_and_evaluate_tasks_use_the_kernels_the_spec_names(kernels, monkeypatch):
    from pipeline.training import tasks
    from pipeline.data.cifar import synthetic_batch
    calls = []
    forward = K.Convolution2D.forward_cpu
    monkeypatch.setattr(K.Convolution2D, "forward_cpu",
                        lambda self, inputs: calls.append(1) or forward(self, inputs))
    images, labels = synthetic_batch(0, "train", 0, 8)
    params = tasks.init_params("small-cnn", 10, seed=0)
    calls.clear()
    spec = tasks.StepSpec("small-cnn", 10, "sgd", 0.9, 0.0, (0.01,), 8, "steps", 0, 0, 0,
                          cpu_kernels=kernels)
    tasks.train(params, None, Shard(images, labels), spec)
    trained = len(calls)
    tasks.evaluate(params, images, labels, tasks.EvalSpec("small-cnn", 10, cpu_kernels=kernels))
    evaluated = len(calls) - trained
    assert (trained > 0, evaluated > 0) == ((True, True) if kernels == "ours" else (False, False))


# ---- batch normalization -------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 16, 8, 8), (4, 5, 3, 7), (1, 2, 1, 1)])
def test_batch_normalization_matches_chainer(shape):
    r = _rng(shape[1])
    x, gamma, beta = r.standard_normal(shape) * 3 + 1, r.standard_normal(shape[1]), \
        r.standard_normal(shape[1])
    gy = r.standard_normal(shape)
    results = []
    for fn in (F.batch_normalization, K.batch_normalization):
        mean, var = np.zeros(shape[1]), np.ones(shape[1])
        vs = [chainer.Variable(a.copy()) for a in (x, gamma, beta)]
        with warnings.catch_warnings():  # Chainer warns about a batch of one sample
            warnings.simplefilter("ignore")
            y = fn(*vs, eps=2e-5, running_mean=mean, running_var=var, decay=0.9)
        y.grad = gy
        y.backward()
        results.append([y.array, mean, var] + [v.grad for v in vs])
    for ours, theirs in zip(results[1], results[0]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-10)
    with chainer.no_backprop_mode():  # inference with the running statistics
        np.testing.assert_allclose(K.fixed_batch_normalization(x, gamma, beta, mean, var).array,
                                   F.fixed_batch_normalization(x, gamma, beta, mean, var).array,
                                   rtol=1e-10, atol=1e-10)


def test_batch_normalization_check_backward():
    r = _rng(9)
    inputs = (r.standard_normal((3, 4, 3, 5)), r.standard_normal(4), r.standard_normal(4))
    gradient_check.check_backward(K.batch_normalization, inputs, r.standard_normal((3, 4, 3, 5)),
                                  dtype=np.float64, atol=1e-5, rtol=1e-5)


def test_batch_normalization_link_dispatch_and_statistics():
    from pipeline.backends.chainer.compat import L
    x = _rng(2).standard_normal((4, 3, 5, 5)).astype(np.float32)
    ours, theirs = cpu_kernels.BatchNormalization(3), L.BatchNormalization(3)
    with chainer.using_config("train", True):
        y1, y0 = ours(x), theirs(x)
    assert isinstance(y1.creator, K.BatchNormalization)
    np.testing.assert_allclose(y1.array, y0.array, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.avg_mean, theirs.avg_mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ours.avg_var, theirs.avg_var, rtol=1e-6, atol=1e-7)
    with chainer.using_config("train", False):
        with chainer.no_backprop_mode():  # inference: our fixed-statistics kernel
            np.testing.assert_allclose(ours(x).array, theirs(x).array, rtol=1e-5, atol=1e-5)
        assert not isinstance(ours(x).creator, K.FixedBatchNormalization)  # a graph: Chainer's


# ---- linear --------------------------------------------------------------------------------

def _linear_run(x, w, b, gy, threads=1):
    xv, wv, bv = (chainer.Variable(v.copy()) for v in (x, w, b))
    with chainer.using_config("cpu_kernel_threads", threads):
        y = F.linear(xv, wv, bv)
        y.grad = gy.copy()
        y.backward()
    return type(y.creator).__name__, [y.array, xv.grad, wv.grad, bv.grad]


def test_linear_is_chainers_to_float32_rounding_and_the_same_bits_on_any_thread_count(monkeypatch):
    """Each product's output in fixed pieces (a 5-wide piece here: 3-4 pieces a product) that
    threads share; no element's sum is cut, so the threads change no bit."""
    from threadpoolctl import threadpool_limits
    from pipeline.backends.chainer.cpu_kernels import linear, stock
    stock.install()
    monkeypatch.setattr(linear, "PIECE", 5)
    r = _rng(11)
    x = r.standard_normal((16, 3, 2, 3)).astype(np.float32)
    w = (r.standard_normal((17, 18)) * 0.3).astype(np.float32)
    b, gy = r.standard_normal(17).astype(np.float32), r.standard_normal((16, 17)).astype(np.float32)
    with threadpool_limits(1):
        name, ours = _linear_run(x, w, b, gy)
        runs = [_linear_run(x, w, b, gy, threads)[1] for threads in (2, 3)]
        with chainer.using_config("cpu_kernels", "chainer"):
            chainers_name, chainers = _linear_run(x, w, b, gy)
    assert (name, chainers_name) == ("Linear", "LinearFunction")
    for a, c in zip(ours, chainers):
        assert a.shape == c.shape and np.allclose(a, c, rtol=1e-5, atol=1e-5)
    for run in runs:
        for a, c in zip(run, ours):
            assert a.tobytes() == c.tobytes()


def test_linear_keeps_double_backprop():
    """A gradient of a gradient (a gradient penalty) goes through Chainer's functions."""
    from unittest import mock
    from pipeline.backends.chainer.cpu_kernels import linear, stock
    stock.install()
    r = _rng(12)
    x, w = r.standard_normal((4, 6)), r.standard_normal((3, 6)) * 0.5
    b = r.standard_normal(3)
    args = [a.astype(np.float32) for a in (x, w, b)]
    gy, ggs = r.standard_normal((4, 3)).astype(np.float32), [
        r.standard_normal(a.shape).astype(np.float32) for a in args]
    assert type(F.linear(*args).creator).__name__ == "Linear"
    seen = []
    real = linear.Linear._differentiable
    with mock.patch.object(linear.Linear, "_differentiable",
                           lambda self, *a: seen.append(1) or real(self, *a)):
        gradient_check.check_double_backward(F.linear, tuple(args), gy, tuple(ggs), eps=1e-2,
                                             atol=5e-2, rtol=5e-2)
    assert seen  # float32 throughout: ours ran, its backward built Chainer's graph
