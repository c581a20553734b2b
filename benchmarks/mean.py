"""Benchmark: the exact mean of K replica states, NumPy blocks vs the compiled pass.

``pipeline.averaging.exact.combine_finalize`` (what a tree's root and ``gather``'s sums run) on
K states shaped like a model's (its parameters, and with ``--adam`` both Adam moments: 3x the
bytes), once with the five NumPy passes per cache-sized block and once with the compiled loop
(``pipeline.averaging.compiled``), alternated; checks that both give the same bits and prints
the ratio (NumPy seconds over compiled seconds). Also the float64 partial sums of a tree's
inner level (``finalize`` of weighted sums: the compiled loop with one input).

    .venv/bin/python benchmarks/mean.py --model cifar10-2015 --adam
"""
from __future__ import annotations

import argparse
import statistics
import time

from _common import emit, same_bits  # noqa: I001  (puts the repo on the path)


def states(model: str, k: int, adam: bool) -> list[dict]:
    """K states: the model's initial weights moved apart by seeded noise (and Adam's m, v)."""
    import numpy as np

    from pipeline.training import tasks
    base = tasks.init_params(model, 10, 0)
    out = []
    for i in range(k):
        rng = np.random.default_rng(i)
        s = {key: (v + rng.standard_normal(v.shape).astype(v.dtype) * 1e-3)
             if v.dtype.kind == "f" else v for key, v in base.items()}
        if adam:
            s.update({f"opt/{key}/{m}": np.abs(rng.standard_normal(v.shape)).astype(v.dtype)
                      for key, v in base.items() if v.dtype.kind == "f" for m in ("m", "v")})
        out.append(s)
    return out


def timed(fn, repeats: int) -> tuple[float, object]:
    best, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best.append(time.perf_counter() - start)
    return statistics.median(best), out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cifar10-2015")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--adam", action="store_true", help="with both Adam moments (3x the bytes)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    from pipeline.averaging import compiled, exact
    S = states(a.model, a.replicas, a.adam)
    weighted = [exact.leaf(s, w) for s, w in zip(S, range(1, a.replicas + 1))]
    nbytes = sum(v.nbytes for v in S[0].values())
    rows, on = {}, compiled.MIN_SIZE
    exact.combine_finalize(S)  # compiles (or loads the cached loop) before timing
    for what, fn in (("mean", lambda: exact.combine_finalize(S)),
                     ("partials", lambda: exact.finalize(exact.combine(weighted)))):
        numpy_s, compiled_s, outs = [], [], []
        for _ in range(a.repeats):  # alternated: the machine's speed drifts
            compiled.MIN_SIZE = 1 << 62
            t, ref = timed(fn, 1)
            numpy_s.append(t)
            compiled.MIN_SIZE = on
            t, new = timed(fn, 1)
            compiled_s.append(t)
            outs.append(same_bits(ref, new))
        rows[what] = {"numpy_ms": round(statistics.median(numpy_s) * 1e3, 1),
                      "compiled_ms": round(statistics.median(compiled_s) * 1e3, 1),
                      "ratio": round(statistics.median(numpy_s) / statistics.median(compiled_s), 2),
                      "same_bits": all(outs)}
        print(f"{what:9} {a.replicas} states of {nbytes / 1e6:.1f} MB: NumPy blocks "
              f"{rows[what]['numpy_ms']} ms, compiled {rows[what]['compiled_ms']} ms "
              f"({rows[what]['ratio']}x), same bits: {rows[what]['same_bits']}")
    emit({"bench": "mean", "model": a.model, "replicas": a.replicas, "adam": a.adam,
          "state_mb": round(nbytes / 1e6, 1), **rows, "ratio": rows["mean"]["ratio"],
          "same_bits": all(r["same_bits"] for r in rows.values())})


if __name__ == "__main__":
    main()
