"""Benchmark: an elastic run that starts on one worker and grows to three, against a fixed run on
three: images/s before and after the join.

`ipm` K=3 (small-cnn, synthetic data, momentum SGD) on a LocalCluster of one-thread worker
processes. The grown run starts on 1 worker; after round ``--join-after`` its ``on_round`` hook
scales the cluster to 3 and waits for them (a worker process takes ~3 s to start: that wait is
in the join's rounds, which are left out of both rates); the replicas are placed over the three
from the next round boundary (``pipeline.training.elastic``). The fixed run has its 3 workers
from the start. Rates come from the runs' metrics lines (images and seconds per round): before
= rounds 1..join-after (round 0 holds each worker's first imports), after = join-after+3..end;
the fixed run's over the same rounds; ``*_transfers_after``: the fetches from another worker in
those rounds (metrics.jsonl ``transfers``). Both runs must end with the same bytes (the script fails
otherwise).

    flock /work/cpu.lock .venv/bin/python benchmarks/elastic.py        # ~1 min on 2 cores
"""
from __future__ import annotations

import argparse

from _common import bench_config, common_arguments, emit, same_bits  # noqa: I001


def rate(history: list, first: int, last: int) -> float:
    """Images per second over rounds ``first..last`` of a run's metrics lines."""
    images = sum(line["images"] for line in history[first:last + 1])
    return images / (history[last]["seconds"] - history[first - 1]["seconds"])


def one_run(cfg, workers: int, join_after: int | None) -> dict:
    import dask
    from distributed import Client, LocalCluster

    from pipeline import train
    from pipeline.cluster.embedded import quiet_config
    with dask.config.set(quiet_config()):
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               dashboard_address=None, host="127.0.0.1")
    with cluster, Client(cluster) as client:
        client.wait_for_workers(workers)

        def grow(line):
            if line["round"] == join_after:
                cluster.scale(3)
                client.wait_for_workers(3, timeout=120)

        result = train(cfg, client=client, on_round=grow if join_after is not None else None,
                       log=lambda m: None)
    return {"history": result.history, "params": result.params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, epochs=2, batch_size=16, mix_every="4")
    parser.set_defaults(data="synthetic:3072:512")
    parser.add_argument("--join-after", type=int, default=7, help="round after which it grows")
    a = parser.parse_args()
    cfg = bench_config(a, **{"train.strategy": "ipm", "train.replicas": 3})
    grown = one_run(cfg, 1, a.join_after)
    fixed = one_run(cfg, 3, None)
    if not same_bits(grown["params"], fixed["params"]):
        raise SystemExit("the grown run's weights differ from the fixed run's")
    j, end = a.join_after, len(fixed["history"]) - 1
    figures = {
        "rounds": end + 1, "join_after": j,
        "grown_before": round(rate(grown["history"], 1, j), 1),
        "grown_after": round(rate(grown["history"], j + 3, end), 1),
        "fixed3_before": round(rate(fixed["history"], 1, j), 1),
        "fixed3_after": round(rate(fixed["history"], j + 3, end), 1),
        "grown_transfers_after": sum(x["transfers"] for x in grown["history"][j + 3:]),
        "fixed3_transfers_after": sum(x["transfers"] for x in fixed["history"][j + 3:]),
        "workers": [line["workers"]["count"] for line in grown["history"]],
        "same_bits": True,
    }
    figures["after_over_fixed3"] = round(figures["grown_after"] / figures["fixed3_after"], 3)
    emit(figures)


if __name__ == "__main__":
    main()
