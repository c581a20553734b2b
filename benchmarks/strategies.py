"""Benchmark: accuracy against epochs and wall time for single, gradient, mixture and ipm.

K replicas (default 4) on a LocalCluster of two one-thread workers; ipm at several H and ipm
with outer Nesterov momentum (DiLoCo-style). ``single`` uses batch K*B so every strategy takes
the same global batch; ``gradient`` is then step for step the same computation as ``single``
(the tests check it), distributed. Synthetic data by default, or real CIFAR-10 with ``--data``.
Writes a two-panel plot (``--plot``) and prints a table; the last line is one JSON object.

    .venv/bin/python benchmarks/strategies.py               # ~6 min on 2 cores
    .venv/bin/python benchmarks/strategies.py --data cifar10 --epochs 10 --model cifar10-2015
"""
from __future__ import annotations

import argparse
from pathlib import Path

from _common import REPO, bench_config, common_arguments, emit, local_client, timed  # noqa: I001


def variants(k: int, b: int):
    return [
        ("single", {"train.strategy": "single", "train.replicas": 1, "train.batch_size": k * b}),
        ("gradient", {"train.strategy": "gradient"}),
        ("mixture", {"train.strategy": "mixture"}),
        ("ipm H=4", {"train.strategy": "ipm", "average.mix_every": "4"}),
        ("ipm H=16", {"train.strategy": "ipm", "average.mix_every": "16"}),
        ("ipm H=1ep", {"train.strategy": "ipm", "average.mix_every": "1ep"}),
        ("ipm H=16 outer m=0.5", {"train.strategy": "ipm", "average.mix_every": "16",
                                  "average.outer_momentum": 0.5, "average.outer_lr": 1.0}),
    ]


def main(argv=None):
    from matplotlib.figure import Figure

    from pipeline import train
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(p, epochs=2, batch_size=8)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--plot", default=str(REPO / "docs" / "strategies.png"))
    a = p.parse_args(argv)
    base = bench_config(a, **{"train.replicas": a.replicas, "augment.policy": "cifar"})
    results = {}
    with local_client(2, 1) as client:
        for name, changes in variants(a.replicas, a.batch_size):
            out, seconds = timed(train, base.replace(**changes), client=client,
                                 log=lambda m: None)
            results[name] = (out.history, seconds)
    fig = Figure(figsize=(11, 4), layout="constrained")
    by_epoch, by_time = fig.subplots(1, 2)
    print(f"{'strategy':22}{'test acc':>9}{'seconds':>9}{'MB averaged':>12}")
    for name, (history, seconds) in results.items():
        tested = [h for h in history if "test_acc" in h]
        by_epoch.plot([h["epoch_float"] for h in tested], [h["test_acc"] for h in tested], "o-",
                      label=name)
        by_time.plot([h["seconds"] for h in tested], [h["test_acc"] for h in tested], "o-",
                     label=name)
        mb = sum(h["bytes_averaged"] for h in history) / 1e6
        print(f"{name:22}{tested[-1]['test_acc']:9.3f}{seconds:9.1f}{mb:12.1f}")
    for ax, label in ((by_epoch, "epoch"), (by_time, "wall time (s)")):
        ax.set_xlabel(label)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=8)
    fig.suptitle(f"{a.model} on {a.data}, K={a.replicas}, global batch {a.replicas * a.batch_size}")
    Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.plot, dpi=100)
    print(f"plot: {a.plot}")
    emit({"bench": "strategies", "data": a.data, "model": a.model, "replicas": a.replicas,
          "epochs": a.epochs, "plot": a.plot,
          "test_acc": {n: h[-1].get("test_acc") for n, (h, _) in results.items()},
          "seconds": {n: round(s, 1) for n, (_, s) in results.items()}})


if __name__ == "__main__":
    main()
