"""Benchmark: replicas pinned to workers (the default) against the scheduler placing them.

`ipm` with K replicas on an embedded cluster of W one-thread worker processes (default K = W = 2,
small-cnn on the synthetic set, momentum SGD), the same run twice per repeat, alternating:
``cluster.pin_replicas`` on (replica k's train- tasks prefer worker k mod W, as a rank stays on
its GPU) and off (Dask places them by where their inputs are). ``--loader-workers N`` adds N
one-thread workers that only augment: the training workers then advertise ``RANK-i`` and a
replica is held to its rank by that resource (a soft pin could hand a train- task to a loader).
From the task stream: wall time of the run, each worker's train- compute time, and in how many
rounds the K replicas ran on K different workers. Both settings must give the same bytes (the
script fails otherwise).

    flock /work/cpu.lock .venv/bin/python benchmarks/placement.py        # ~2 min on 2 cores
"""
from __future__ import annotations

import argparse
import collections
import time

from _common import emit, same_bits  # noqa: I001


def one_run(cfg, workers: int, pin: bool, loaders: int = 0) -> dict:
    from distributed import get_task_stream

    from pipeline import train
    from pipeline.core import keys
    from pipeline.cluster.connection import connect
    from pipeline.core.config import ClusterConfig
    cfg = cfg.replace(**{"cluster.pin_replicas": pin})
    quiet = {"log": lambda m: None}
    with connect(ClusterConfig(workers=workers, threads_per_worker=1, loader_workers=loaders,
                               dashboard_address="127.0.0.1:0"), **quiet) as client:
        train(cfg.replace(**{"train.epochs": 0.1}), client=client, **quiet)  # warm-up
        with get_task_stream(client) as stream:
            start = time.perf_counter()
            result = train(cfg, client=client, **quiet)
            wall = time.perf_counter() - start
    busy, where = collections.Counter(), collections.defaultdict(set)
    for record in stream.data:
        key = record["key"]
        if keys.stage_of(key) == "train" and len(key) == 3:  # not its picks (..., name)
            busy[record["worker"]] += sum(s["stop"] - s["start"] for s in record["startstops"]
                                          if s["action"] == "compute")
            where[key[1]].add(record["worker"])
    replicas = cfg.train.replicas
    spread = sum(len(w) == min(replicas, workers) for w in where.values())
    return {"wall": wall, "busy": sorted(busy.values(), reverse=True), "rounds": len(where),
            "spread_rounds": spread, "params": result.params}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--loader-workers", type=int, default=0,
                   help="more one-thread workers that only decode and augment (then the "
                        "training workers are held to their replicas by RANK-i resources)")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--mix-every", default="10", help="steps per round (H)")
    p.add_argument("--batch-size", type=int, default=32, help="per replica")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from pipeline import Config
    cfg = Config().replace(**{
        "data.source": "synthetic", "model.name": "small-cnn", "train.strategy": "ipm",
        "train.replicas": a.replicas, "train.batch_size": a.batch_size, "train.epochs": a.epochs,
        "average.mix_every": a.mix_every, "seed": a.seed, "progress": False,
        "checkpoint_every": 0, "eval_every": 0})
    runs = {True: [], False: []}
    for _ in range(a.repeats):
        for pin in (True, False):
            runs[pin].append(one_run(cfg, a.workers, pin, a.loader_workers))
    first = runs[True][0]["params"]
    same = all(same_bits(r["params"], first) for rs in runs.values() for r in rs)
    if not same:
        raise SystemExit("pinned and unpinned runs gave different weights")
    paired = [u["wall"] / p_["wall"] for p_, u in zip(runs[True], runs[False])]
    for pin, rs in runs.items():
        print(f"pin_replicas {'on ' if pin else 'off'}: wall {[round(r['wall'], 2) for r in rs]} "
              f"s; rounds with the replicas on {min(a.replicas, a.workers)} workers "
              f"{[r['spread_rounds'] for r in rs]} of {rs[0]['rounds']}; train- seconds per "
              f"worker {[[round(b, 2) for b in r['busy']] for r in rs]}")
    print(f"unpinned / pinned, run by run: {[round(x, 3) for x in paired]}")
    emit({"bench": "placement",
          "unpinned_over_pinned_mean": round(sum(paired) / len(paired), 3),
          "unpinned_over_pinned_worst": round(max(paired), 3),
          "unpinned_over_pinned": [round(x, 3) for x in paired],
          "wall_s": {("pinned" if pin else "unpinned"): [round(x["wall"], 3) for x in rs]
                     for pin, rs in runs.items()},
          "spread_rounds": {("pinned" if pin else "unpinned"): [x["spread_rounds"] for x in rs]
                            for pin, rs in runs.items()},
          "rounds": runs[True][0]["rounds"], "same_bytes": same, "workers": a.workers,
          "loader_workers": a.loader_workers,
          "replicas": a.replicas, "mix_every": a.mix_every, "epochs": a.epochs})


if __name__ == "__main__":
    main()
