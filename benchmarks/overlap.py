"""Benchmark: does augmentation overlap with training? Time per epoch with it, without it, alone.

Chainer's MultiprocessIterator (the post in docs/references.md) overlaps loading with compute, so an
epoch costs max(compute, loading) rather than their sum. Here the driver submits `augment-` tasks
``--prefetch`` rounds ahead, and they run on a second worker thread while `train-` tasks run.
Three timings on one LocalCluster (one worker process, two threads):

- train-only: ``--augment none`` (the shard is still gathered, no augmentation op runs);
- augment-only: the same epoch's `augment-` tasks with the policy, and no training;
- with augmentation: the full pipeline with the policy.

Target: with / max(train-only, augment-only) <= 1.1.

    .venv/bin/python benchmarks/overlap.py                  # ~2 min on 2 cores
"""
from __future__ import annotations

import argparse
import time

from _common import bench_config, common_arguments, emit, local_client, timed  # noqa: I001


def config(a, policy):
    return bench_config(a, **{"train.strategy": "ipm", "train.replicas": a.replicas,
                              "augment.policy": policy, "augment.prefetch": a.prefetch})


def augment_only(client, cfg) -> float:
    """Seconds to run every augment- task of the run, with no training."""
    from distributed import wait

    from pipeline.training import graph
    from pipeline.training import strategies
    from pipeline.data.datasets import load_dataset
    from pipeline.core.schedule import steps_per_epoch
    from pipeline.training.strategies.base import Context
    ds = load_dataset(cfg.data.source)
    data = graph.persist_dataset(client, ds)
    wait(data.train_images + data.train_labels)
    g = graph.RoundGraph(client, data, cfg, n_classes=ds.n_classes, device="cpu",
                         train_resources=None, augment_resources=None)
    t = cfg.train
    per_epoch = steps_per_epoch(data.n_train, t.replicas, t.batch_size)
    ctx = Context(cfg, t.replicas, data.n_train, per_epoch, ds.n_classes, "cpu")
    rounds = strategies.get(t.strategy)(ctx, g).rounds()
    start = time.perf_counter()
    futures = [g.submit_augment(r, k, t.replicas, t.batch_size) for r in rounds
               for k in range(t.replicas)]
    wait(futures)
    seconds = time.perf_counter() - start
    del futures
    return seconds


def main(argv=None):
    from pipeline import train
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(p, epochs=2, batch_size=64, mix_every="10")
    p.add_argument("--policy", default="cifar-cutout")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--prefetch", type=int, default=2)
    a = p.parse_args(argv)
    with local_client(1, 2) as client:
        quiet = dict(client=client, log=lambda m: None)
        train(config(a, "none").replace(**{"train.epochs": 0.1}), **quiet)  # warm the worker up
        _, train_s = timed(train, config(a, "none"), **quiet)
        aug_s = augment_only(client, config(a, a.policy))
        _, with_s = timed(train, config(a, a.policy), **quiet)
    per = {k: v / a.epochs for k, v in (("train_only", train_s), ("augment_only", aug_s),
                                        ("with_augment", with_s))}
    ratio = per["with_augment"] / max(per["train_only"], per["augment_only"])
    for name, seconds in per.items():
        print(f"{name:14} {seconds:8.2f} s/epoch")
    print(f"ratio with / max(train, augment) = {ratio:.3f} (target <= 1.1)")
    emit({"bench": "overlap", "ratio": round(ratio, 4),
          **{f"{k}_s_per_epoch": round(v, 3) for k, v in per.items()}, "policy": a.policy,
          "prefetch": a.prefetch, "target": 1.1})


if __name__ == "__main__":
    main()
