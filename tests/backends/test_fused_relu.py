"""BatchNorm then ReLU, and an addition then ReLU, in one pass (``cpu_kernels.fused_relu``): the
bits of the two functions run one after the other, compiled or not, on any thread count."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pipeline.backends.chainer import cpu_kernels as K
from pipeline.backends.chainer.compat import F, chainer
from pipeline.backends.chainer.cpu_kernels import fused, fused_relu

EXAMPLES = settings(max_examples=40, deadline=None, derandomize=True, database=None)


def _specials(a, r):
    """Zeros of both signs, NaN and infinities sprinkled in."""
    a[r.random(a.shape) < 0.05] = -0.0
    a[r.random(a.shape) < 0.05] = 0.0
    a[r.random(a.shape) < 0.01] = r.choice([np.nan, np.inf, -np.inf])
    return a


def _same(a, b) -> bool:
    """The same bits, zeros' signs included; NaN where the other has NaN (its sign and payload
    are the arithmetic's, and a run stops at the first NaN)."""
    nan = np.isnan(a)
    return (a.dtype == b.dtype and np.array_equal(nan, np.isnan(b))
            and a[~nan].tobytes() == b[~nan].tobytes())


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf * 0, as Chainer's
@EXAMPLES
@given(m=st.integers(1, 300), c=st.integers(1, 40), dtype=st.sampled_from([np.float32, np.float64]),
       seed=st.integers(0, 2**16))
def test_the_compiled_passes_give_the_two_functions_bits(m, c, dtype, seed):
    r = np.random.default_rng(seed)
    x = _specials(r.standard_normal((m, c)).astype(dtype), r)
    gy = _specials(r.standard_normal((m, c)).astype(dtype), r)
    gamma, beta = (r.standard_normal(c).astype(dtype) for _ in range(2))
    gamma[0] = 0.0  # a channel whose output is beta alone
    mean, var = fused.statistics(x)
    inv_std = np.reciprocal(np.sqrt(var + dtype(2e-5), dtype=dtype))
    y, x_hat = fused.normalize(x, mean, inv_std, gamma, beta)
    relu_y = np.maximum(y, 0, dtype=dtype)  # ReLU.forward_cpu
    g = np.asarray(gy * (relu_y > 0), dtype=dtype)  # ReLUGrad2.forward_cpu
    scale = gamma * inv_std
    want_sums = fused.grad_sums(g, x_hat)
    a, b = scale * want_sums[1], scale * want_sums[0]
    want = [relu_y, x_hat, *want_sums, fused.grad_x(g, x_hat, scale, a, b)]
    for compiled in (True, False):
        got = [*fused_relu.normalize_relu(x, mean, inv_std, gamma, beta, compiled),
               *fused_relu.grad_sums_relu(gy, x_hat, gamma, beta, compiled),
               fused_relu.grad_x_relu(gy, x_hat, gamma, beta, scale, a, b, compiled)]
        for got_one, want_one in zip(got, want):
            assert _same(got_one, want_one)
    a2 = _specials(r.standard_normal((m, c)).astype(dtype), r)
    for compiled in (True, False):
        s = x + a2
        assert _same(fused_relu.add_relu(x, a2, compiled), np.maximum(s, 0, dtype=dtype))


def _graph(fn, arrays, gy, threads=1):
    variables = [chainer.Variable(a.copy()) for a in arrays]
    with chainer.using_config("cpu_kernel_threads", threads):
        y = fn(*variables)
        y.grad = gy.copy()
        y.backward()
    return [y.array] + [v.grad for v in variables]


@pytest.mark.parametrize("threads", [1, 3])
def test_batchnorm_with_relu_and_add_relu_are_the_separate_functions_bits(threads, monkeypatch):
    """In a graph, NHWC memory as our convolutions hand it on, the running statistics too."""
    monkeypatch.setattr(fused, "SLICE", 96)  # several slices for the threads
    r = np.random.default_rng(2)

    def nhwc(shape):
        return np.ascontiguousarray(r.standard_normal(shape).astype(np.float32)
                                    .transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    x, other, gy = nhwc((4, 6, 5, 5)), nhwc((4, 6, 5, 5)), nhwc((4, 6, 5, 5))
    gamma, beta = r.standard_normal(6).astype(np.float32), r.standard_normal(6).astype(np.float32)
    stats = {}

    def bn(relu):
        def run(xv, g, b):
            mean, var = np.zeros(6, np.float32), np.ones(6, np.float32)
            stats[relu] = (mean, var)
            from pipeline.backends.chainer.cpu_kernels import functions
            y = functions.batch_normalization(xv, g, b, 2e-5, mean, var, 0.9, relu=relu)
            return y if relu else F.relu(y)
        return run
    fused_run = _graph(bn(True), [x, gamma, beta], gy, threads)
    separate = _graph(bn(False), [x, gamma, beta], gy, threads)
    for a, b in zip(fused_run, separate):
        assert a.tobytes() == b.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(stats[True], stats[False]))
    ours = _graph(K.add_relu, [x, other], gy, threads)
    theirs = _graph(lambda a, b: F.relu(a + b), [x, other], gy, threads)
    for a, b in zip(ours, theirs):
        assert a.tobytes() == b.tobytes()


def test_the_link_takes_relu_on_every_path():
    """Our kernels fuse it; Chainer's functions (``cpu_kernels "chainer"``) apply F.relu after."""
    link = K.BatchNormalization(3)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    with chainer.using_config("train", True):
        ours = link(x, relu=True)
        assert type(ours.creator).__name__ == "BatchNormalization"
        with chainer.using_config("cpu_kernels", "chainer"):
            theirs = link(x, relu=True)
    assert type(theirs.creator).__name__ == "ReLU"
    np.testing.assert_allclose(ours.array, theirs.array, rtol=1e-5, atol=1e-5)
    assert (ours.array >= 0).all()
    with chainer.using_config("train", False), chainer.no_backprop_mode():
        assert (link(x, relu=True).array >= 0).all()
