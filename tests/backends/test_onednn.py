"""Convolutions through oneDNN (``cpu_kernels.onednn``): the im2col path's results to float
tolerance for every geometry, the same bits at any thread count, and the im2col path wherever
oneDNN does not run (no library, PIPELINE_ONEDNN=0, float64, a window that skips the last rows)."""
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pipeline.backends.chainer.cpu_kernels import convolution, onednn

EXAMPLES = settings(max_examples=40, deadline=None, derandomize=True, database=None)
DECLARED = platform.system() == "Linux" and platform.machine() == "x86_64"  # setup.cfg's marker
# where the library does not load, these skip; test_onednn_is_there_and_loads says why it must
needs_onednn = pytest.mark.skipif(onednn.load() is None,
                                  reason=f"oneDNN does not load here: {onednn.unavailable_reason()}")


@pytest.mark.skipif(not DECLARED, reason="onednn-cpu-gomp is a requirement on Linux x86-64 only")
@pytest.mark.skipif(os.environ.get("PIPELINE_ONEDNN", "").lower() in ("0", "off", "false", "no"),
                    reason="turned off by PIPELINE_ONEDNN")
def test_onednn_is_there_and_loads():
    """A declared requirement: without it every convolution runs im2col + BLAS, slower."""
    assert onednn.load() is not None, onednn.unavailable_reason()
    assert onednn.version().startswith("3.")


def _passes(x, w, b, stride, pad, threads=1):
    y, source, source_pad = convolution.forward(x, w, b, stride, pad, threads)
    gy = np.random.default_rng(1).standard_normal(y.shape).astype(x.dtype)
    gx = convolution.grad_x(gy, w, x.shape, stride, pad, threads)
    gw, gb = convolution.grad_w(source, gy, *w.shape[2:], stride, source_pad, b is not None,
                                threads)
    return y, gx, gw, gb


def _problem(n, h, w_, c, o, k, stride, pad, bias, seed):
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, h, w_, c)).astype(np.float32)
    w = (r.standard_normal((o, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    b = r.standard_normal(o).astype(np.float32) if bias else None
    return x, w, b, (stride, stride), (pad, pad)


@needs_onednn
@EXAMPLES
@given(n=st.integers(1, 70), h=st.integers(5, 20), w_=st.integers(5, 20), c=st.integers(1, 20),
       o=st.integers(1, 20), k=st.sampled_from([1, 3, 5]), stride=st.sampled_from([1, 2]),
       pad=st.integers(0, 2), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_onednn_gives_the_im2col_results(n, h, w_, c, o, k, stride, pad, bias, seed):
    x, w, b, stride, pad = _problem(n, h, w_, c, o, k, stride, pad, bias, seed)
    calls = onednn.stats["calls"]
    ours = _passes(x, w, b, stride, pad)
    ran = onednn.stats["calls"] - calls
    with onednn.turned_off():
        ref = _passes(x, w, b, stride, pad)
    assert ran == 3  # windows that never read the last rows: the part they read, cut
    for got, want in zip(ours, ref):
        if want is None:
            assert got is None
            continue
        assert got.shape == want.shape and got.dtype == want.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@needs_onednn
@pytest.mark.parametrize("geometry", [
    (100, 32, 32, 16, 16, 3, 1, 1, True),   # resnet20's first stage; 4 chunks of 25
    (100, 32, 32, 16, 32, 3, 2, 1, False),  # its stride-2 entry
    (37, 17, 13, 3, 32, 5, 1, 2, True),     # cifar10-2015's first layer, odd sizes
])
def test_onednn_gives_the_same_bits_at_any_thread_count(geometry):
    x, w, b, stride, pad = _problem(*geometry, seed=3)
    one = _passes(x, w, b, stride, pad, threads=1)
    assert len(onednn.chunks(len(x))) > 1
    for threads in (2, 3):
        for a, c in zip(one, _passes(x, w, b, stride, pad, threads=threads)):
            if a is None:
                assert c is None
            else:
                np.testing.assert_array_equal(a, c)


@needs_onednn
def test_float64_takes_the_im2col_path_and_windows_short_of_the_edge_read_a_cut():
    calls = onednn.stats["calls"]
    x, w, b, stride, pad = _problem(4, 8, 8, 3, 5, 3, 1, 1, True, seed=0)
    _passes(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), stride, pad)
    assert onednn.stats["calls"] == calls
    x, w, b, stride, pad = _problem(4, 8, 8, 3, 5, 1, 2, 0, False, seed=0)  # 1x1 at stride 2
    assert onednn.pad_right(8, 1, 2, 0) == -1  # the last row and column are never read
    y, gx, gw, _ = _passes(x, w, b, stride, pad)
    assert onednn.stats["calls"] == calls + 3 and gx.shape == x.shape
    assert not gx[:, 7].any() and not gx[:, :, 7].any()  # no gradient where no window reads
    with onednn.turned_off():
        ref = _passes(x, w, b, stride, pad)
    for got, want in zip((y, gx, gw), ref):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_empty_batch_gives_empty_results_on_either_path(dtype):
    x, w, b, stride, pad = _problem(1, 8, 8, 3, 4, 3, 1, 1, True, seed=0)
    x, w, b = x[:0].astype(dtype), w.astype(dtype), b.astype(dtype)
    y, gx, gw, gb = _passes(x, w, b, stride, pad)
    assert y.shape == (0, 8, 8, 4) and gx.shape == x.shape
    assert not gw.any() and not gb.any() and gw.dtype == gb.dtype == dtype


@needs_onednn
def test_each_thread_keeps_a_bounded_number_of_plans(monkeypatch):
    from pipeline.backends.chainer.cpu_kernels import dnnl
    monkeypatch.setattr(dnnl, "MAX_PLANS", 4)
    x, w, b, stride, pad = _problem(2, 6, 6, 3, 4, 3, 1, 1, True, seed=0)
    for size in range(6, 12):  # ever new input sizes: 3 plans each
        _passes(np.resize(x, (2, size, size, 3)), w, b, stride, pad)
    assert len(dnnl.thread_state()["plans"]) <= 4


@needs_onednn
def test_each_convolution_runs_on_one_openmp_thread_whatever_its_thread_was_set_to(monkeypatch):
    """The OpenMP setting is the calling thread's own and not ours alone: threadpoolctl restores
    the limits the first task in found from whichever task leaves last
    (``core.threads.limit_blas_threads``), which set a worker thread whose oneDNN had been pinned
    back to the machine's count; its convolutions then split their sums over 2 threads (other
    bits: two replicas as threads of one worker failed now and then). Each call pins it again."""
    import ctypes
    import threading
    from pipeline.backends.chainer.cpu_kernels import dnnl
    gomp = ctypes.CDLL("libgomp.so.1")
    if dnnl._LOAD["omp"] is None:
        pytest.skip("this oneDNN does not run on OpenMP")
    seen, run = [], dnnl.Plan.run

    def spy(plan, stream, arrays):
        seen.append(gomp.omp_get_max_threads())
        return run(plan, stream, arrays)

    x, w, b, stride, pad = _problem(8, 8, 8, 3, 4, 3, 1, 1, True, seed=0)

    def work():
        _passes(x, w, b, stride, pad)  # this thread's plans and pin
        gomp.omp_set_num_threads(4)  # another party, as threadpoolctl's restore did
        monkeypatch.setattr(dnnl.Plan, "run", spy)
        _passes(x, w, b, stride, pad)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen and set(seen) == {1}, seen


def test_chunks_depend_on_the_batch_alone():
    assert onednn.chunks(1) == [(0, 1)]
    assert onednn.chunks(32) == [(0, 32)]
    assert onednn.chunks(33) == [(0, 17), (17, 33)]
    for n in (1, 31, 100, 257):
        cut = onednn.chunks(n)
        assert cut[0][0] == 0 and cut[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
        assert max(hi - lo for lo, hi in cut) <= onednn.CHUNK_IMAGES


CHILD = """
import numpy as np
from pipeline.backends.chainer.cpu_kernels import convolution, onednn
x = np.ones((2, 6, 6, 3), np.float32); w = np.ones((4, 3, 3, 3), np.float32)
y = convolution.forward(x, w, None, (1, 1), (1, 1))[0]
print(onednn.load() is None, onednn.unavailable_reason(), float(y[0, 2, 2, 0]), onednn.stats["calls"])
"""


@pytest.mark.parametrize("setting, reason", [
    ("0", "PIPELINE_ONEDNN=0"),
    ("/nonexistent/libdnnl.so.3", "/nonexistent/libdnnl.so.3"),
])
def test_without_the_library_the_im2col_path_runs(setting, reason):
    env = {**os.environ, "PIPELINE_ONEDNN": setting}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    missing, *why, value, calls = run.stdout.split()
    assert missing == "True" and reason in " ".join(why)
    assert float(value) == 27.0 and calls == "0"
