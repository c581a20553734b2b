"""Benchmark: BatchNorm's training passes (forward + backward) on one thread, NumPy vs compiled.

Both are ``cpu_kernels.fused`` with the same bits: its NumPy reference (what runs without Numba:
one pass per operation, a float64 cumulative sum per channel sum) against the Numba loops. The
previous kernel (NumPy passes, BLAS sums) is timed beside them, copied below, for the history.
Shapes are resnet20's at batch 100: (N*H*W, C) = (102400, 16), (25600, 32), (6400, 64).
Last line: one JSON object with milliseconds and ratios.
"""
from __future__ import annotations

import argparse
import json
import time

from _common import REPO  # noqa: F401  (makes the repo importable)

import numpy as np

SHAPES = [(102400, 16), (25600, 32), (6400, 64)]


def _before(x, gy, gamma, beta, eps=2e-5):
    """The kernel before fused.py (commit 15e63d3): NumPy passes on widened rows, BLAS sums."""
    from pipeline.backends.chainer.cpu_kernels.fused import wide
    m, c = x.shape
    dt = x.dtype

    def csum(a):
        return np.ones(a.shape[0], a.dtype) @ a
    mean = csum(x) / dt.type(m)
    xw, r = wide(x, c)
    x_hat = np.subtract(xw, np.tile(mean, r))
    sq = np.square(x_hat)
    var = csum(sq.reshape(m, c)) / dt.type(m)
    inv_std = np.reciprocal(np.sqrt(var + dt.type(eps), dtype=dt))
    x_hat *= np.tile(inv_std, r)
    y = np.multiply(x_hat, np.tile(gamma, r), out=sq)
    y += np.tile(beta, r)
    gbeta = csum(gy)
    gyw, _ = wide(gy, c)
    tmp = np.multiply(gyw, x_hat)
    ggamma = csum(tmp.reshape(m, c))
    scale = gamma * inv_std
    np.multiply(x_hat, np.tile(scale * ggamma / m, r), out=tmp)
    tmp += np.tile(scale * gbeta / m, r)
    gx = np.multiply(gyw, np.tile(scale, r))
    gx -= tmp
    return y, gx


def _ours(x, gy, gamma, beta, compiled):
    from pipeline.backends.chainer.cpu_kernels import fused
    dt = x.dtype
    mean, var = fused.statistics(x, compiled)
    inv_std = np.reciprocal(np.sqrt(var + dt.type(2e-5), dtype=dt))
    y, x_hat = fused.normalize(x, mean, inv_std, gamma, beta, compiled)
    gbeta, ggamma = fused.grad_sums(gy, x_hat, compiled)
    scale = gamma * inv_std
    inv_m = dt.type(1.0 / x.shape[0])
    return y, fused.grad_x(gy, x_hat, scale, scale * ggamma * inv_m, scale * gbeta * inv_m,
                           compiled)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20, help="best of this many")
    a = p.parse_args(argv)
    from threadpoolctl import threadpool_limits
    from pipeline.backends.chainer.cpu_kernels import fused
    threadpool_limits(1)
    if not fused.compiled():
        raise SystemExit("Numba cannot be imported here: nothing to compare")
    rng = np.random.default_rng(0)
    out = {}
    for m, c in SHAPES:
        x = (rng.standard_normal((m, c)) * 2 + 1).astype(np.float32)
        gy = rng.standard_normal((m, c)).astype(np.float32)
        gamma, beta = rng.standard_normal(c).astype(np.float32), np.zeros(c, np.float32)
        runs = {"before": lambda: _before(x, gy, gamma, beta),
                "numpy": lambda: _ours(x, gy, gamma, beta, False),
                "compiled": lambda: _ours(x, gy, gamma, beta, True)}
        best = {k: float("inf") for k in runs}
        for _ in range(a.repeats):  # interleaved
            for name, fn in runs.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
        same = all(np.array_equal(u, v) for u, v in zip(runs["numpy"](), runs["compiled"]()))
        row = {k: round(v * 1e3, 3) for k, v in best.items()}
        row.update(compiled_over_numpy=round(best["numpy"] / best["compiled"], 2),
                   compiled_over_before=round(best["before"] / best["compiled"], 2), same_bits=same)
        out[f"{m}x{c}"] = row
        print(f"{m:>7} x {c:<3} before {row['before']:7.2f} ms   numpy {row['numpy']:7.2f} ms   "
              f"compiled {row['compiled']:6.2f} ms   x{row['compiled_over_before']} over before, "
              f"same bits as numpy: {same}")
    print(json.dumps({"bench": "batchnorm", "threads": 1, "dtype": "float32",
                      "fwd_bwd_ms": out}))


if __name__ == "__main__":
    main()
