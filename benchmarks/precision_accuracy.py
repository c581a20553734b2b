"""Benchmark: does bf16 keep fp32's test accuracy, for single and for ipm with K=2?

Four runs at equal epochs on real CIFAR-10 images (the first ``--train-images`` / ``--test-images``
of the archive in ../shared/data, 5,085 / 2,000 by default: its whole test split, so one
evaluation has a standard error of about 1.1 points): cifar10-2015, Adam lr 1e-3, batch
100 per replica, pad-crop-flip, seed 0, test accuracy after every epoch, for ``single`` fp32,
``single`` bf16, ``ipm`` K=2 fp32 and ``ipm`` K=2 bf16 (``--precision``; the rest as the
defaults of ``Config``). One JSON line per run (its curve), and a last line with each run's final
accuracy and its mean over the last five evaluations, and the bf16 - fp32 differences in points
(``bf16_gap_single`` / ``bf16_gap_ipm``, mean of the last five: ``..._mean_last5``). Goal: each
final gap within 1 point.

Accuracy at equal epochs does not depend on the machine's load or the worker count (one-thread
workers give the same bytes), so it runs at low priority:

    nice -n 19 .venv/bin/python benchmarks/precision_accuracy.py      # ~15 min on 2 shared cores
    .venv/bin/python benchmarks/precision_accuracy.py --data synthetic --train-images 200 \\
        --test-images 100 --epochs 1 --runs single:fp32                          # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import time

from _common import emit, local_client  # noqa: I001

REAL = "/work/shared/data/cifar10-jpeg-20k/cifar-10-python.tar.gz"
RUNS = ("single:fp32", "single:bf16", "ipm:fp32", "ipm:bf16")


def load(a):
    """``(x_train, y_train, x_test, y_test)`` uint8 / int arrays: the first images of the archive,
    or random ones for ``--data synthetic`` (a smoke run needs no data set)."""
    import numpy as np
    if a.data == "synthetic":
        rng = np.random.default_rng(a.seed)
        n = a.train_images + a.test_images
        x, y = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), np.arange(n) % 10
        return x[:a.train_images], y[:a.train_images], x[a.train_images:], y[a.train_images:]
    from peer import load_real  # the same cut as peer.py's train part
    return load_real(a)


def config(a, strategy: str, precision: str):
    from pipeline import Config
    return Config().replace(**{
        "model.name": a.model, "train.strategy": strategy,
        "train.replicas": 1 if strategy == "single" else a.replicas, "train.optimizer": "adam",
        "train.lr": a.lr, "train.batch_size": a.batch_size, "train.epochs": a.epochs,
        "train.precision": precision, "augment.policy": "cifar", "seed": a.seed,
        "progress": False, "checkpoint_every": 0})


def run(a, client, arrays, item: str) -> dict:
    from pipeline import train
    from pipeline.data.arrays import ArrayData
    from pipeline.data.cifar import CIFAR10_LABEL_NAMES
    strategy, precision = item.split(":")
    data = ArrayData(*arrays, n_classes=10, label_names=tuple(CIFAR10_LABEL_NAMES))
    start = time.perf_counter()
    out = train(config(a, strategy, precision), client=client, data=data, log=lambda m: None)
    curve = [[round(h["epoch_float"], 2), round(h["test_acc"], 4)] for h in out.history
             if "test_acc" in h]
    row = {"run": item, "final_acc": curve[-1][1], "mean_last5": mean_last5(curve),
           "seconds": round(time.perf_counter() - start, 1), "curve": curve}
    print(json.dumps(row), flush=True)
    return row


def mean_last5(curve) -> float:
    """The mean test accuracy of the last five evaluations (one moves 1-2 points an epoch)."""
    last = [acc for _, acc in curve[-5:]]
    return round(sum(last) / len(last), 4)


def gaps(rows: dict) -> dict:
    """bf16 - fp32 in points, final and mean of the last five, for each strategy run in both.

    >>> gaps({"single:fp32": {"final_acc": 0.6, "mean_last5": 0.59},
    ...       "single:bf16": {"final_acc": 0.595, "mean_last5": 0.6}})
    {'bf16_gap_single': -0.5, 'bf16_gap_single_mean_last5': 1.0}
    """
    out = {}
    for strategy in ("single", "ipm"):
        fp32, bf16 = rows.get(f"{strategy}:fp32"), rows.get(f"{strategy}:bf16")
        if fp32 and bf16:
            out[f"bf16_gap_{strategy}"] = round(100 * (bf16["final_acc"] - fp32["final_acc"]), 2)
            out[f"bf16_gap_{strategy}_mean_last5"] = round(
                100 * (bf16["mean_last5"] - fp32["mean_last5"]), 2)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=REAL, help="CIFAR-10 python tarball, or synthetic")
    p.add_argument("--train-images", type=int, default=5085)
    p.add_argument("--test-images", type=int, default=2000)
    p.add_argument("--model", default="cifar10-2015")
    p.add_argument("--epochs", type=float, default=20)
    p.add_argument("--batch-size", type=int, default=100, help="per replica")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's alpha")
    p.add_argument("--replicas", type=int, default=2, help="ipm's K")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="one-thread workers of the cluster")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS,
                   help="STRATEGY:PRECISION items, run in this order")
    a = p.parse_args(argv)
    if a.data != "synthetic" and not os.path.exists(a.data):
        raise SystemExit(f"precision_accuracy.py: {a.data}: no such file (--data synthetic "
                         "for a smoke run)")
    arrays = load(a)
    rows = {}
    with local_client(a.workers, 1) as client:
        for item in a.runs:
            rows[item] = run(a, client, arrays, item)
    names = {item: item.replace(":", "_") for item in rows}  # single:bf16 -> single_bf16_final
    emit({"bench": "precision_accuracy", "model": a.model, "epochs": a.epochs,
          "train_images": len(arrays[0]), "test_images": len(arrays[2]), "seed": a.seed,
          **{f"{names[k]}_final": r["final_acc"] for k, r in rows.items()},
          **{f"{names[k]}_mean_last5": r["mean_last5"] for k, r in rows.items()}, **gaps(rows)})


if __name__ == "__main__":
    main()
