"""bf16 convolutions through oneDNN: inputs rounded to bfloat16, products summed in float32.

Tolerance: bf16 keeps 8 significant bits, so each rounded input is within 2^-9 relative
(half an ulp) and each product within ~2^-8; oneDNN sums them in float32, where the errors of
independent roundings partly cancel. Measured here, max |bf16 - fp32| / max |fp32| is ~2.3e-3 on
every pass; we allow 1e-2 (2.5 ulps of bf16 at the largest value). Against float32 on the same
rounded inputs only the summation order differs: 1e-5.
"""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.backends.chainer.cpu_kernels import convolution, dnnl, onednn
from pipeline.backends.chainer.cpu_kernels.bf16 import from_bf16, to_bf16
from pipeline.core import precision

pytestmark = pytest.mark.skipif(
    onednn.load() is None or precision.bf16_support(precision.cpu_flags()) is not None,
    reason="bf16 convolutions need oneDNN and a CPU with amx_bf16 or avx512_bf16")

BF16_TOLERANCE = 1e-2  # relative to the largest |value|: see the module's docstring


def _problem(seed=0, n=20, c=16, o=32, k=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 12, 12, c), dtype=np.float32)
    w = (rng.standard_normal((o, c, k, k)) * 0.2).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32)
    gy = rng.standard_normal((n, 12, 12, o)).astype(np.float32)
    return x, w, b, gy


def _passes(x, w, b, gy, bf16, threads=1):
    y, source, pad = convolution.forward(x, w, b, (1, 1), (1, 1), threads, bf16)
    g = to_bf16(gy) if bf16 else gy
    gx = convolution.grad_x(g, w, x.shape, (1, 1), (1, 1), threads, bf16)
    gw, gb = convolution.grad_w(source, g, 3, 3, (1, 1), pad, True, threads, bf16)
    return y, gx, gw, gb


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_rounding_is_to_nearest_even_and_matches_onednn():
    rng = np.random.default_rng(0)
    v = rng.standard_normal(10_000).astype(np.float32) * 1e3
    r = from_bf16(to_bf16(v))
    assert np.all(np.abs(r - v) <= np.abs(v) * 2.0 ** -8)  # within half an ulp of 8 bits
    assert np.all(to_bf16(r) == to_bf16(v))  # idempotent
    ties = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8], np.float32)  # halfway: to the even one
    assert from_bf16(to_bf16(ties)).tolist() == [1.0, 1 + 2 ** -6]


def test_onednns_rounding_gives_the_numpy_helpers_bits():
    rng = np.random.default_rng(4)
    v = np.concatenate([rng.standard_normal(100_003).astype(np.float32) * 10.0 ** rng.integers(
        -30, 30, 100_003), np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, 1e-45], np.float32)])
    v = v.astype(np.float32)
    assert np.array_equal(dnnl.round_bf16(v), to_bf16(v))
    assert np.array_equal(onednn.as_bf16(v.reshape(-1, 1)), to_bf16(v).reshape(-1, 1))


def test_the_three_passes_in_bf16_are_close_to_fp32_and_write_fp32():
    x, w, b, gy = _problem()
    before = dnnl.stats["bf16_calls"]  # a count: dnnl.impls keeps only the first 50 plans
    low, full = _passes(x, w, b, gy, True), _passes(x, w, b, gy, False)
    for name, a, ref in zip(("y", "gx", "gw", "gb"), low, full):
        assert a.dtype == np.float32, name
        assert 0 < _rel(a, ref) < BF16_TOLERANCE, (name, _rel(a, ref))
    assert dnnl.stats["bf16_calls"] >= before + 3  # the three passes ran through oneDNN in bf16


def test_bf16_forward_is_fp32_on_the_rounded_inputs():
    x, w, b, gy = _problem(1)
    y = convolution.forward(x, w, b, (1, 1), (1, 1), 1, True)[0]
    rounded = convolution.forward(from_bf16(to_bf16(x)), from_bf16(to_bf16(w)), b, (1, 1),
                                  (1, 1), 1, False)[0]
    assert _rel(y, rounded) < 1e-5


def test_bf16_backward_passes_are_fp32_on_the_rounded_inputs():
    x, w, b, gy = _problem(3)
    low = _passes(x, w, b, gy, True)
    xr, wr, gyr = (from_bf16(to_bf16(v)) for v in (x, w, gy))
    rounded = _passes(xr, wr, b, gyr, False)
    for name, a, ref in zip(("y", "gx", "gw", "gb"), low, rounded):
        assert _rel(a, ref) < 1e-5, (name, _rel(a, ref))


def test_bf16_gives_the_same_bits_at_any_thread_count():
    x, w, b, gy = _problem(2, n=100)
    one, two = _passes(x, w, b, gy, True, 1), _passes(x, w, b, gy, True, 2)
    for a, c in zip(one, two):
        assert a.tobytes() == c.tobytes()


def test_linear_in_bf16_is_fp32_on_the_rounded_inputs_on_any_thread_count(monkeypatch):
    from pipeline.backends.chainer.compat import F, chainer
    from pipeline.backends.chainer.cpu_kernels import linear, stock
    stock.install()
    monkeypatch.setattr(linear, "PIECE", 3)  # several pieces per product for the threads
    rng = np.random.default_rng(5)
    x = rng.standard_normal((20, 8, 3, 5)).astype(np.float32)
    w = (rng.standard_normal((7, 120)) * 0.1).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float32)
    gy = rng.standard_normal((20, 7)).astype(np.float32)

    def run(precision, threads=1):
        xv, wv, bv = (chainer.Variable(v.copy()) for v in (x, w, b))
        with chainer.using_config("cpu_precision", precision), \
                chainer.using_config("cpu_kernel_threads", threads):
            y = F.linear(xv, wv, bv)
        y.grad = gy.copy()
        y.backward()
        return type(y.creator).__name__, y.array, xv.grad, wv.grad, bv.grad

    name, y, gx, gw, gb = run("bf16")
    assert name == "Linear" and gx.shape == x.shape
    r = lambda v: from_bf16(to_bf16(v))  # noqa: E731
    x2 = r(x.reshape(20, -1))
    for got, want in ((y, x2 @ r(w).T + b), (gx.reshape(20, -1), r(gy) @ r(w)),
                      (gw, r(gy).T @ x2)):
        assert _rel(got, want) < 1e-5
    assert np.array_equal(gb, gy.sum(axis=0))
    for a, c in zip(run("bf16", threads=3)[1:], (y, gx, gw, gb)):
        assert a.tobytes() == c.tobytes()


def test_rounding_shared_among_threads_gives_the_bits_of_one(monkeypatch):
    from pipeline.backends.chainer.compat import chainer
    monkeypatch.setattr(onednn, "ROUND_SLICE", 1000)  # 13 slices, the last one short
    x = np.random.default_rng(4).standard_normal((3, 7, 11, 53)).astype(np.float32)
    x.flat[:4] = [np.inf, -np.inf, np.nan, -0.0]
    runs = []
    for threads in (1, 2, 3):
        with chainer.using_config("cpu_kernel_threads", threads):
            runs.append(onednn.as_bf16(x))
    assert runs[0].tobytes() == to_bf16(x).tobytes()
    assert runs[1].tobytes() == runs[0].tobytes() and runs[2].tobytes() == runs[0].tobytes()
