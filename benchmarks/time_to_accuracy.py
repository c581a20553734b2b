"""Benchmark: does ipm hold single's accuracy as the global batch grows, and does K=2 save time?

Two figures on real images (``cifar10-2015``, the net of the Chainer + Dask post in
docs/references.md; Adam, per-replica batch 100):

- ``equal_epoch_gap_k4``: single's final test accuracy minus ipm's with K=4 replicas (global
  batch 400) after the same epochs, in points (goal <= 2), and ``gap_k4_mean_last5``, the gap
  averaged over the last five evaluations (one evaluation moves 1-2 points epoch to epoch). ipm
  runs with the scale-out recipe that is the default for K > 1 (``--no-recipe``: the plain
  settings, for comparison).
- ``time_ratio_k2``: wall time until ipm with K=2 replicas on two workers comes within a point
  of single's final test accuracy, over single's wall time on the same cluster (goal: < 1, the
  K=2 gain kept; the issue measured 0.53 before the recipe).
- ``--part replicas`` (issue 44): ``single`` and ``ipm`` at each K of ``--replicas`` at equal
  epochs, one JSON line per run with every epoch's test accuracy, then the summary: the mean
  test accuracy over epochs 16-20 (``--mean-from`` to the last epoch), its gap to single per
  K in points (``acc_gap_points_k<K>``; goals: K = 4, 8 within 1 point, K = 16 within 2), and
  the sequential steps per replica at which each K first reaches single's final accuracy
  over single's steps (goal for K = 8: <= 1/4). ``--train-images N`` keeps the first N training images of the archive;
  ``--set field=JSON`` sets a config field of the ipm runs (a candidate).

Both runs keep a constant learning rate after the warmup; ``--lr-decay cosine`` decays both.

Accuracy at equal epochs does not depend on the machine; the time ratio does: run that part
under ``flock /work/cpu.lock`` on a quiet machine. ``--device gpu`` trains on the GPU workers of
an embedded cluster (one per visible GPU), for the equal-epoch part on a GPU box.

    .venv/bin/python benchmarks/time_to_accuracy.py --part equal-epoch --epochs 10
    flock /work/cpu.lock .venv/bin/python benchmarks/time_to_accuracy.py --part time --epochs 10
    python benchmarks/time_to_accuracy.py --part equal-epoch --epochs 10 --device gpu
    nice -n 19 .venv/bin/python benchmarks/time_to_accuracy.py --part replicas --epochs 20 \
        --replicas 1,2,4,8,16 --train-images 5000
"""
from __future__ import annotations

import argparse
import json
import os
import time

from _common import emit, local_client, real_cifar  # noqa: I001

REAL = "/work/shared/data/cifar10-jpeg-20k/cifar-10-python.tar.gz"


def config(a, **fields):
    from pipeline import Config
    base = {"data.source": a.data, "model.name": a.model, "train.optimizer": a.optimizer,
            "train.lr": a.lr, "train.batch_size": a.batch_size, "train.epochs": a.epochs,
            "train.device": a.device, "augment.policy": "cifar", "seed": a.seed,
            "progress": False, "checkpoint_every": 0, "train.recipe": not a.no_recipe,
            "train.lr_decay": a.lr_decay}
    return Config().replace(**{**base, **fields})


def run(cfg, client=None, label="", data=None):
    from pipeline import train
    start = time.perf_counter()
    out = train(cfg, client=client, log=lambda m: None, data=data)
    seconds = time.perf_counter() - start
    curve = [(round(h["epoch_float"], 2), h["test_acc"], h["seconds"]) for h in out.history
             if "test_acc" in h]
    print(f"{label:10} " + " ".join(f"e{e:g}:{acc:.4f}" for e, acc, _ in curve)
          + f"  ({seconds:.0f} s)", flush=True)
    return curve, seconds


def real_subset(path: str, n: int):
    """The first ``n`` training images of a CIFAR-10 python tarball and its whole test split, as
    ``train(data=...)`` takes them: ``(n, 3, 32, 32) uint8`` images, ``(n,) int32`` labels."""
    from pipeline.data.arrays import ArrayData
    x, y, xt, yt = real_cifar(path, n)
    return ArrayData(x, y, xt, yt, n_classes=10)


def per_epoch_steps(n_train: int, k: int, batch: int) -> int:
    """Sequential steps per epoch (each replica's): full global batches of K x B.

    >>> per_epoch_steps(5000, 16, 100)
    3
    """
    return n_train // (k * batch)


def reach_steps(curve: list, target: float, per_epoch: int) -> int | None:
    """Sequential steps at the first evaluation with accuracy >= ``target`` (None: never).

    >>> reach_steps([(1, .3, 0), (2, .5, 0)], .4, 50)
    100
    """
    return next((round(e * per_epoch) for e, acc, _ in curve if acc >= target), None)


def replicas_part(a) -> dict:
    """single (K = 1) and ipm at each K of ``a.replicas`` at equal epochs on ``a.workers``."""
    data, n_train = None, None
    if a.train_images:
        data = real_subset(a.data, a.train_images)
        n_train = len(data.y_train)
    extra = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    curves = {}
    with local_client(a.workers, 1) as client:
        for k in a.replicas:
            fields = ({"train.strategy": "single", "train.replicas": 1} if k == 1 else
                      {"train.strategy": "ipm", "train.replicas": k, **extra})
            label = "single" if k == 1 else f"ipm K={k}"
            curves[k], seconds = run(config(a, **fields), client, label, data=data)
            print(json.dumps({"run": label, "K": k, "seconds": round(seconds, 1),
                              "set": extra if k > 1 else {},
                              "epoch": [e for e, _, _ in curves[k]],
                              "test_acc": [acc for _, acc, _ in curves[k]]}), flush=True)
    return summarise(curves, a, n_train)


def summarise(curves: dict, a, n_train: int | None) -> dict:
    """Per K (flat fields, ``_k<K>``): the mean accuracy over the last epochs, its gap to single
    in points, and the steps to single's final accuracy over single's steps."""
    n_train = n_train or 17966
    first = a.mean_from
    last = {k: [acc for e, acc, _ in c if e >= first] for k, c in curves.items()}
    means = {k: sum(accs) / max(1, len(accs)) for k, accs in last.items()}
    out = {"train_images": n_train, "replicas": a.replicas,
           "set": dict(x.split("=", 1) for x in a.set), "mean_from_epoch": first}
    out.update({f"mean_acc_k{k}": round(m, 4) for k, m in means.items()})
    if 1 not in curves:
        return out
    target = curves[1][-1][1]
    single_steps = per_epoch_steps(n_train, 1, a.batch_size) * a.epochs
    steps = {k: reach_steps(c, target, per_epoch_steps(n_train, k, a.batch_size))
             for k, c in curves.items()}
    for k in (k for k in curves if k != 1):
        out[f"acc_gap_points_k{k}"] = round(100 * (means[1] - means[k]), 2)
        out[f"steps_to_single_final_k{k}"] = steps[k]
        out[f"steps_ratio_k{k}"] = round(steps[k] / single_steps, 3) if steps[k] else None
    return out


def equal_epoch(a) -> dict:
    single = dict(**{"train.strategy": "single", "train.replicas": 1})
    ipm = dict(**{"train.strategy": "ipm", "train.replicas": 4})
    if a.device == "gpu":  # train() starts an embedded cluster with the GPU workers
        s, _ = run(config(a, **single), label="single")
        k4, _ = run(config(a, **ipm), label="ipm K=4")
    else:  # equal epochs: accuracy only, any number of workers gives the same bytes
        with local_client(a.workers, 1) as client:
            s, _ = run(config(a, **single), client, "single")
            k4, _ = run(config(a, **ipm), client, "ipm K=4")
    gaps = [round(100 * (x[1] - y[1]), 2) for x, y in zip(s, k4)]
    last = gaps[-5:]  # one evaluation of either run moves 1-2 points from epoch to epoch
    return {"equal_epoch_gap_k4": gaps[-1], "gap_k4_mean_last5": round(sum(last) / len(last), 2),
            "gap_by_epoch_k4": gaps,
            "single_test_acc": s[-1][1], "ipm_k4_test_acc": k4[-1][1]}


def time_part(a) -> dict:
    with local_client(2, 1) as client:
        run(config(a, **{"train.strategy": "single", "train.replicas": 1,
                         "train.epochs": 0.05}), client, "warm-up")
        s, s_seconds = run(config(a, **{"train.strategy": "single", "train.replicas": 1}),
                           client, "single")
        k2, k2_seconds = run(config(a, **{"train.strategy": "ipm", "train.replicas": 2}),
                             client, "ipm K=2")
    target = s[-1][1] - 0.01
    reach = next((t for _, acc, t in k2 if acc >= target), None)
    return {"time_ratio_k2": round(reach / s_seconds, 3) if reach is not None else None,
            "single_seconds": round(s_seconds, 1), "ipm_k2_seconds": round(k2_seconds, 1),
            "ipm_k2_test_acc": k2[-1][1], "single_test_acc_time_part": s[-1][1]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=REAL if os.path.exists(REAL) else "synthetic")
    p.add_argument("--model", default="cifar10-2015")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--lr", type=float, default=0.001, help="Adam's alpha before scaling")
    p.add_argument("--batch-size", type=int, default=100, help="per replica")
    p.add_argument("--epochs", type=float, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--workers", type=int, default=2, help="CPU workers of the equal-epoch part")
    p.add_argument("--part", default="all", choices=["all", "equal-epoch", "time", "replicas"])
    p.add_argument("--replicas", type=lambda v: [int(x) for x in v.split(",")],
                   default=[1, 2, 4, 8, 16], help="replicas part: K per run (1: single)")
    p.add_argument("--train-images", type=int, default=0,
                   help="replicas part: the first N training images of --data (0: all)")
    p.add_argument("--mean-from", type=float, default=16,
                   help="replicas part: mean accuracy over epochs from this one to the end")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help="replicas part: a config field of the ipm runs (a candidate)")
    p.add_argument("--lr-decay", default="none", choices=["none", "cosine"],
                   help="the learning-rate decay of both runs after the warmup")
    p.add_argument("--no-recipe", action="store_true", help="ipm without the scale-out recipe")
    a = p.parse_args(argv)
    figures = {"bench": "time_to_accuracy", "data": a.data, "model": a.model,
               "epochs": a.epochs, "device": a.device, "recipe": not a.no_recipe,
               "lr_decay": a.lr_decay,
               "equal_epoch_gap_k4": None, "time_ratio_k2": None}
    if a.part == "replicas":
        figures.pop("equal_epoch_gap_k4"), figures.pop("time_ratio_k2")
        figures.update({"bench": "time_to_accuracy_replicas", "seed": a.seed,
                        "batch_size": a.batch_size})
        figures.update(replicas_part(a))
    if a.part in ("all", "equal-epoch"):
        figures.update(equal_epoch(a))
    if a.part in ("all", "time"):
        figures.update(time_part(a))
    emit(figures)


if __name__ == "__main__":
    main()
