"""Benchmark: a fresh cluster's first run against a second run on it (the cold start).

Each repeat starts a LocalCluster (one-thread worker processes, the housekeeping intervals of
the cluster ``train`` starts itself), trains twice on it and closes it. The driver has imported
everything before the first cluster starts, so what the first run costs more than the second is
the workers' own: imports (Chainer, our kernels, Numba, the task modules), Numba's cached code,
oneDNN's primitives, first-touch memory. The second run is the baseline: the same work on warm
workers (a notebook's second `train` on its cluster).

- ``cold_extra_s``: the first run's seconds minus the second's;
- ``first_round_s``: each run's seconds to the end of its first round (the history's ``seconds``).

    .venv/bin/python benchmarks/cold_start.py --model cifar10-2015 --batch-size 100 \\
        --mix-every 10 --data synthetic:4000:200 --lr 0.001 --epochs 2 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

from _common import bench_config, common_arguments, emit, local_client  # noqa: I001


def two_runs(a) -> dict:
    """Train twice on one new cluster: each run's seconds and its first round's."""
    from pipeline import train
    cfg = bench_config(a, **{"train.strategy": a.strategy, "train.replicas": a.workers,
                             "augment.policy": "cifar"})
    seconds, first = [], []
    with local_client(a.workers, 1) as client:
        for _ in range(2):
            start = time.perf_counter()
            result = train(cfg, client=client, log=lambda m: None)
            seconds.append(time.perf_counter() - start)
            first.append(result.history[0]["seconds"])
    return {"cold_s": seconds[0], "warm_s": seconds[1], "cold_extra_s": seconds[0] - seconds[1],
            "first_round_cold_s": first[0], "first_round_warm_s": first[1]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(p, epochs=2, batch_size=100, mix_every="10")
    p.add_argument("--strategy", default="ipm", choices=["ipm", "single"])
    p.add_argument("--workers", type=int, default=2, help="one replica each (single: 1)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    if a.strategy == "single":
        a.workers = 1
    import pipeline.backends.chainer.backend  # noqa: F401  the driver's imports, before timing
    import pipeline.training.graph  # noqa: F401
    import pipeline.training.loop  # noqa: F401
    runs = [two_runs(a) for _ in range(a.repeats)]
    med = {f: statistics.median(r[f] for r in runs) for f in runs[0]}
    print(f"{a.strategy}, {a.workers} worker(s), medians of {a.repeats}: cold {med['cold_s']:.2f} s, "
          f"warm {med['warm_s']:.2f} s, cold extra {med['cold_extra_s']:.2f} s; first round "
          f"{med['first_round_cold_s']:.2f} s cold, {med['first_round_warm_s']:.2f} s warm")
    emit({"bench": "cold_start", "model": a.model, "strategy": a.strategy, "workers": a.workers,
          **{f: round(v, 3) for f, v in med.items()},
          "each_cold_extra_s": [round(r["cold_extra_s"], 3) for r in runs],
          "each_first_round_cold_s": [round(r["first_round_cold_s"], 3) for r in runs],
          "repeats": a.repeats})


if __name__ == "__main__":
    main()
