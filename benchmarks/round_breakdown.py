"""Benchmark: where a round's time goes (issue 28): the task stream of one run, per stage.

Runs one training job on a LocalCluster of W one-thread worker processes (made before timing)
and sums the scheduler's task-stream records over the run: compute seconds per stage (the key's
prefix: load, augment, train, average, evaluate, the picks of a tuple result), transfer seconds (a task's inputs fetched from another worker), deserialisation, and the driver's wall
time. ``train_share`` is the train- compute over (wall x W): the cores' share that did training.
And what the run pays once (``run_ends``; the driver has imported the training modules before
the clock starts): each worker's idle and busy seconds before its first train- task, that
task's compute over its others', the seconds after the last one.

    .venv/bin/python benchmarks/round_breakdown.py --model cifar10-2015 --workers 2 --replicas 2
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

from _common import bench_config, common_arguments, emit, local_client  # noqa: I001


def breakdown(records: list) -> dict:
    """Seconds per (stage, action) over task-stream records and tasks per stage."""
    from dask.utils import key_split
    seconds, count = collections.Counter(), collections.Counter()
    for rec in records:
        key = rec.get("key")
        stage = key_split(key[0] if isinstance(key, tuple) else key)
        if isinstance(key, tuple) and isinstance(key[-1], str) and stage != "average":
            stage = f"{stage}/{key[-1]}"  # the picks of a tuple result: train/params ...
        count[stage] += 1
        for ss in rec.get("startstops", ()):
            action = ss.get("action")
            seconds[f"{stage}.{action}" if action == "compute" else action] += \
                ss["stop"] - ss["start"]
    return {"seconds": {k: round(v, 3) for k, v in sorted(seconds.items())},
            "tasks": dict(sorted(count.items()))}


def _is_train(key) -> bool:
    """Whether a task-stream key is a train- task's (``("train-<tok>", round, replica)``), not
    one of its picks."""
    from dask.utils import key_split
    return isinstance(key, tuple) and len(key) == 3 and key_split(key[0]) == "train"


def barriers(records: list) -> list:
    """Seconds each round boundary held the training: from the end of the last train- task of
    round r to the start of the last train- task of round r + 1 (picks, the average and its
    copies, the evaluation at an epoch's end, whatever a worker ran in between)."""
    ends, starts = {}, {}
    for rec in records:
        key = rec.get("key")
        if not _is_train(key):
            continue
        for ss in rec.get("startstops", ()):
            if ss.get("action") == "compute":
                ends.setdefault(key[1], []).append(ss["stop"])
                starts.setdefault(key[1], []).append(ss["start"])
    return [max(starts[r + 1]) - max(ends[r]) for r in sorted(ends) if r + 1 in starts]


def run_ends(records: list, start: float, end: float) -> dict:
    """What a run pays once, per worker: ``idle_before_train`` (seconds from the run's start to
    the worker's first train- task with nothing running there: the driver's set-up, a stalled
    dispatch), ``busy_before_train`` (loading, augmenting, fetching), ``first_train_extra`` (its
    first train- task's compute over the median of its others: a fresh process's imports and
    first compiled calls); and ``tail``: from the last train- task's end to the run's end."""
    spans: dict = {}
    for rec in records:
        is_train = _is_train(rec.get("key"))
        for ss in rec.get("startstops", ()):
            spans.setdefault(rec.get("worker"), []).append(
                (ss["start"], ss["stop"], is_train and ss.get("action") == "compute"))
    workers, last = {}, start
    for worker, items in sorted(spans.items()):
        trains = sorted((a, b) for a, b, t in items if t)
        if not trains:
            continue
        first = trains[0][0]
        busy = sum(min(b, first) - a for a, b, _ in items if a < first)
        others = [b - a for a, b in trains[1:]]
        workers[worker] = {
            "idle_before_train": round(first - start - busy, 3),
            "busy_before_train": round(busy, 3),
            "first_train_extra": round(trains[0][1] - trains[0][0] - statistics.median(others), 3)
            if others else None}
        last = max(last, trains[-1][1])
    return {"workers": workers, "tail": round(end - last, 3)}


def _bytes_sent(client) -> int:
    """Bytes the workers have sent each other so far (their data transfers)."""
    return sum(client.run(lambda dask_worker: dask_worker.transfer_outgoing_bytes_total).values())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(p, epochs=1, batch_size=100, mix_every="10")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per worker")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--strategy", default="ipm")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--detail", default="",
                   help="print every task of these stages, comma-separated (e.g. average,train)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any other config field (repeatable), e.g. cluster.pin_replicas=false")
    a = p.parse_args(argv)
    import pipeline.backends.chainer.backend  # noqa: F401  the driver's imports, before timing
    import pipeline.training.loop  # noqa: F401
    from pipeline import train
    from pipeline.training import task_stream
    extra = {}
    for item in a.set:
        name, value = item.split("=", 1)
        extra[name] = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(extra[name], str) and extra[name].lstrip("-").isdigit():
            extra[name] = int(extra[name])
    cfg = bench_config(a, **{"train.strategy": a.strategy, "train.replicas": a.replicas,
                             "train.optimizer": a.optimizer, "augment.policy": "cifar",
                             "train.lr": 1e-3 if a.optimizer == "adam" else a.lr, **extra})
    with local_client(a.workers, a.threads) as client, task_stream.reader(client) as stream:
        start = time.time()
        sent = _bytes_sent(client)
        result = train(cfg, client=client, log=lambda m: None)
        end = time.time()
        wall = end - start
        sent = _bytes_sent(client) - sent
        records = stream()  # this run's records, by the stream's append count
    figures = breakdown(records)
    t0 = min((ss["start"] for rec in records for ss in rec.get("startstops", ())), default=0.0)
    for rec in records if a.detail else ():  # (action, start since the first record, seconds)
        if any(str(rec.get("key")).find(d) >= 0 for d in a.detail.split(",")):
            print(rec["key"], rec.get("worker"),
                  [(ss["action"], round(ss["start"] - t0, 3), round(ss["stop"] - ss["start"], 3))
                   for ss in rec.get("startstops", ())])
    rounds = len(result.history)
    images = result.history[-1]["step"] * a.batch_size * a.replicas
    train_s = figures["seconds"].get("train.compute", 0.0)
    print(f"{rounds} rounds, {wall:.1f} s wall, {images / wall:.0f} images/s, "
          f"{sent / rounds / 1e6:.1f} MB between workers; per round:")
    for name, value in figures["seconds"].items():
        print(f"  {name:28}{value / rounds:8.3f} s   ({figures['tasks'].get(name.split('.')[0], '')}"
              f" tasks)")
    held = barriers(records)
    if held:
        print(f"  barrier (last train end -> last next train start): median "
              f"{statistics.median(held):.3f} s, mean {statistics.mean(held):.3f} s over "
              f"{len(held)} boundaries")
    once = run_ends(records, start, end)
    for worker, w in once["workers"].items():
        print(f"  once, {worker}: idle {w['idle_before_train']:.3f} s and busy "
              f"{w['busy_before_train']:.3f} s before its first train- task, which ran "
              f"{w['first_train_extra'] if w['first_train_extra'] is not None else float('nan'):.3f}"
              f" s over the median of its others")
    print(f"  once, the end: {once['tail']:.3f} s after the last train- task")
    emit({"bench": "round_breakdown", "model": a.model, "strategy": a.strategy,
          "replicas": a.replicas, "workers": a.workers, "threads": a.threads,
          "rounds": rounds, "wall_s": round(wall, 2), "img_s": round(images / wall, 1),
          "train_share": round(train_s / (wall * a.workers * a.threads), 3),
          "per_round_s": {k: round(v / rounds, 4) for k, v in figures["seconds"].items()},
          "tasks_per_round": round(sum(figures["tasks"].values()) / rounds, 1),
          "mb_sent_per_round": round(sent / rounds / 1e6, 1),
          "barrier_median_s": round(statistics.median(held), 4) if held else None,
          "barrier_mean_s": round(statistics.mean(held), 4) if held else None,
          "barriers_s": [round(b, 3) for b in held],
          "once": once, "test_acc": result.history[-1]["test_acc"], "set": a.set})


if __name__ == "__main__":
    main()
