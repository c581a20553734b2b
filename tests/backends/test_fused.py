"""BatchNorm's compiled passes (``cpu_kernels.fused``): the bits of their NumPy reference, which
is what a machine without Numba runs, for every shape, dtype and value range."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pipeline.backends.chainer.cpu_kernels import fused, normalization

EXAMPLES = settings(max_examples=60, deadline=None, derandomize=True, database=None)


def test_numba_is_there_and_compiles():
    """A declared requirement: without it training runs the reference, same bits, slower."""
    assert fused.compiled()


def _passes(x, gy, gamma, beta, use_compiled):
    dtype = x.dtype
    mean, var = fused.statistics(x, use_compiled)
    inv_std = np.reciprocal(np.sqrt(var + dtype.type(2e-5), dtype=dtype))
    y, x_hat = fused.normalize(x, mean, inv_std, gamma, beta, use_compiled)
    gbeta, ggamma = fused.grad_sums(gy, x_hat, use_compiled)
    scale = gamma * inv_std
    gx = fused.grad_x(gy, x_hat, scale, scale * ggamma, scale * gbeta, use_compiled)
    return mean, var, y, x_hat, gbeta, ggamma, gx


@EXAMPLES
@given(m=st.integers(1, 700), c=st.integers(1, 70), dtype=st.sampled_from([np.float32, np.float64]),
       scale=st.sampled_from([1e-3, 1.0, 1e4]), offset=st.sampled_from([0.0, 3.0, -1e3]),
       seed=st.integers(0, 2**16))
def test_the_compiled_passes_give_the_references_bits(m, c, dtype, scale, offset, seed):
    r = np.random.default_rng(seed)
    x = (r.standard_normal((m, c)) * scale + offset).astype(dtype)
    gy, gamma, beta = (r.standard_normal(s).astype(dtype) for s in ((m, c), c, c))
    for ours, ref in zip(_passes(x, gy, gamma, beta, True), _passes(x, gy, gamma, beta, False)):
        assert ours.dtype == ref.dtype == dtype
        np.testing.assert_array_equal(ours, ref)


def test_the_passes_on_threads_give_the_bits_of_one(monkeypatch):
    """normalize and grad_x by row slices shared among threads; the sums one loop each."""
    from pipeline.backends.chainer.compat import chainer
    monkeypatch.setattr(fused, "SLICE", 64)  # 4 rows of 16 channels a slice: 50 slices
    r = np.random.default_rng(8)
    x, gy = (r.standard_normal((203, 16)).astype(np.float32) for _ in range(2))
    gamma, beta = (r.standard_normal(16).astype(np.float32) for _ in range(2))
    runs = []
    for threads in (1, 2, 3):
        with chainer.using_config("cpu_kernel_threads", threads):
            runs.append([a.tobytes() for a in _passes(x, gy, gamma, beta, True)])
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_the_sums_are_sequential_in_float64():
    """Row by row in float64, rounded once: 1 + 1000 * 1e-8 is 1.00001 (a float32 running sum
    stays at 1.0)."""
    x = np.full((1001, 2), 1e-8, np.float32)
    x[0] = 1.0
    mean, _ = fused.statistics(x)
    s = np.float64(1.0)
    for v in x[1:, 0]:
        s += np.float64(v)
    assert mean[0] == np.float32(s / 1001) and mean[1] == mean[0]


@pytest.mark.parametrize("c", [1, 2, 3, 16, 513])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sums_whose_order_shows_in_the_bits_agree(c, dtype):
    """Values over 25 decades: a pairwise or blocked sum would give other bits than the loops'."""
    r = np.random.default_rng(c)
    m = 40000 // c + 7
    x = (r.standard_normal((m, c)) * 10.0 ** r.integers(-8, 17, (m, c))).astype(dtype)
    gy = (r.standard_normal((m, c)) * 10.0 ** r.integers(-8, 17, (m, c))).astype(dtype)
    for ours, ref in zip((fused.statistics(x), fused.grad_sums(gy, x)),
                         (fused.statistics(x, False), fused.grad_sums(gy, x, False))):
        for a, b in zip(ours, ref):
            np.testing.assert_array_equal(a, b)
    s = np.zeros(c)
    for row in x.astype(np.float64):
        s += row
    np.testing.assert_array_equal(fused.statistics(x)[0], (s / m).astype(dtype))


def test_batch_normalization_without_numba_is_the_same_bits(monkeypatch):
    r = np.random.default_rng(5)
    x, gy = (r.standard_normal((6400, 16)).astype(np.float32) for _ in range(2))
    gamma, beta = r.standard_normal(16).astype(np.float32), r.standard_normal(16).astype(np.float32)

    def run():
        running = (np.zeros(16, np.float32), np.ones(16, np.float32))
        y, x_hat, inv_std = normalization.forward(x, gamma, beta, 2e-5, running)
        return (y, x_hat, inv_std, *running, *normalization.backward(gy, x_hat, gamma, inv_std))
    compiled = run()
    monkeypatch.setattr(fused, "_compiled", lambda: None)
    assert not fused.compiled()
    for a, b in zip(compiled, run()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["F", "strided"])
def test_inputs_not_c_contiguous_are_read_as_their_values(layout):
    r = np.random.default_rng(1)
    x = r.standard_normal((300, 8)).astype(np.float32)
    gamma, beta = r.standard_normal(8).astype(np.float32), r.standard_normal(8).astype(np.float32)
    other = np.asfortranarray(x) if layout == "F" else np.repeat(x, 2, axis=1)[:, ::2]
    for a, b in zip(normalization.forward(x, gamma, beta, 2e-5),
                    normalization.forward(other, gamma, beta, 2e-5)):
        np.testing.assert_array_equal(a, b)


# ---- the ReLU gradient ------------------------------------------------------------------------

def _relu_inputs(layout: str, dtype, seed: int = 0):
    r = np.random.default_rng(seed)
    shape = (3, 5, 4, 6)
    gy = r.standard_normal(shape).astype(dtype)
    y = np.maximum(r.standard_normal(shape), 0).astype(dtype)
    gy.flat[:6] = [np.inf, -np.inf, np.nan, -0.0, 0.0, -2.0]  # with y = 0: NaN, NaN, NaN, -0, 0, -0
    y.flat[:6] = 0.0
    y.flat[6:9] = [np.nan, np.inf, -0.0]
    if layout == "nhwc":  # what our kernels hand Chainer: NCHW shape, channels-last memory
        gy, y = (np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2) for a in (gy, y))
    elif layout == "fortran":
        gy, y = np.asfortranarray(gy), np.asfortranarray(y)
    elif layout == "mixed":  # not one layout: Chainer's expression
        y = np.asfortranarray(y)
    elif layout == "strided":
        gy, y = (np.repeat(a, 2, axis=3)[..., ::2] for a in (gy, y))
    return gy, y


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply")  # inf * 0, as Chainer
@pytest.mark.parametrize("layout", ["c", "nhwc", "fortran", "mixed", "strided"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_gradient_is_chainers_bit_for_bit(layout, dtype):
    gy, y = _relu_inputs(layout, dtype)
    want = np.asarray(gy * (y > 0), dtype=dtype)  # ReLUGrad2.forward_cpu
    for compiled in (True, False):
        got = fused.relu_grad(gy, y, compiled)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want))  # -0.0 where Chainer has it
    if layout in ("c", "nhwc", "fortran"):  # one dense layout: the compiled loop, same order
        assert fused.relu_grad(gy, y).strides == gy.strides


@pytest.mark.parametrize("layout", ["c", "nhwc", "fortran", "mixed", "strided"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_is_chainers_bit_for_bit_on_any_thread_count(layout, dtype, monkeypatch):
    from pipeline.backends.chainer.compat import chainer
    x, _ = _relu_inputs(layout, dtype)  # inf, -inf, NaN, -0.0, 0.0 among its values
    want = np.maximum(x, 0, dtype=dtype)  # ReLU.forward_cpu
    monkeypatch.setattr(fused, "SLICE", 7)  # 52 slices for the threads
    for compiled, threads in ((True, 1), (True, 3), (False, 1)):
        with chainer.using_config("cpu_kernel_threads", threads):
            got = fused.relu(x, compiled)
            grad = fused.relu_grad(x, want, compiled)
        assert got.dtype == want.dtype and got.strides == want.strides
        assert got.tobytes() == want.tobytes()
        assert grad.tobytes() == np.asarray(x * (want > 0), dtype=dtype).tobytes()


def test_relu_in_a_graph_runs_ours_with_chainers_bits_and_double_backprop(monkeypatch):
    from pipeline.backends.chainer.compat import F, chainer
    from pipeline.backends.chainer.cpu_kernels import activations, stock
    calls = []
    for name in ("relu_grad_forward_cpu", "relu_forward_cpu"):
        ours = getattr(activations, name)
        monkeypatch.setattr(activations, name, lambda node, inputs, ours=ours:
                            calls.append(ours.__name__) or ours(node, inputs))
    r = np.random.default_rng(3)
    x0 = r.standard_normal((2, 3, 4, 5)).astype(np.float32)

    def grads():
        x = chainer.Variable(x0.copy())
        y = F.sum(F.relu(x) * F.relu(x))
        gx, = chainer.grad([y], [x], enable_double_backprop=True)
        ggx, = chainer.grad([F.sum(gx * gx)], [x])
        return gx.array, ggx.array
    with chainer.using_config("cpu_kernels", "chainer"):
        want = grads()
    stock.install()  # puts the (wrapped) forwards on ReLU and ReLUGrad2
    try:
        got = grads()
    finally:
        stock.uninstall()
    assert set(calls) == {"relu_grad_forward_cpu", "relu_forward_cpu"}
    assert stock.installed() is False
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
