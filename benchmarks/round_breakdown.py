"""Benchmark: where a round's time goes (issue 28): the task stream of one run, per stage.

Runs one training job on a LocalCluster of W one-thread worker processes (made before timing)
and sums the scheduler's task-stream records over the run: compute seconds per stage (the key's
prefix: load, augment, train, average, evaluate, the picks of a tuple result), transfer seconds (a task's inputs fetched from another worker), deserialisation, and the driver's wall
time. ``train_share`` is the train- compute over (wall x W): the cores' share that did training.

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


def barriers(records: list) -> list:
    """Seconds each round boundary held the training: from the end of the last train- task of
    round r to the start of the last train- task of round r + 1 (picks, the average and its
    copies, the evaluation at an epoch's end, whatever a worker ran in between)."""
    from dask.utils import key_split
    ends, starts = {}, {}
    for rec in records:
        key = rec.get("key")
        if not (isinstance(key, tuple) and len(key) == 3 and key_split(key[0]) == "train"):
            continue
        for ss in rec.get("startstops", ()):
            if ss.get("action") == "compute":
                ends.setdefault(key[1], []).append(ss["stop"])
                starts.setdefault(key[1], []).append(ss["start"])
    return [max(starts[r + 1]) - max(ends[r]) for r in sorted(ends) if r + 1 in starts]


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
    p.add_argument("--detail", default="", help="print every task of this stage (e.g. average)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any other config field (repeatable), e.g. cluster.pin_replicas=false")
    a = p.parse_args(argv)
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
        wall = time.time() - start
        sent = _bytes_sent(client) - sent
        records = stream()  # this run's records, by the stream's append count
    figures = breakdown(records)
    for rec in records if a.detail else ():
        if str(rec.get("key")).find(a.detail) >= 0:
            print(rec["key"], rec.get("worker"), [(ss["action"], round(ss["stop"] - ss["start"], 3))
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
          "test_acc": result.history[-1]["test_acc"], "set": a.set})


if __name__ == "__main__":
    main()
