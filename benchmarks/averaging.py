"""Benchmark: the average- tree reduction of K replica states vs a point-to-point transfer.

For each K (a LocalCluster of K one-thread worker processes) and model size L (state dicts of
float32 arrays), with the K states already in memory on K distinct workers:

- p2p: time to move one L-byte state from worker 1 to worker 0 (a task on 0 that depends on it),
- reduce: ``pipeline.averaging.reduction.tree_reduce`` with ``exact.combine/finalize``, submit to the
  root's completion (the averaged state exists on one worker),
- allreduce: the same plus every worker holding the averaged state (the next round's inputs),

each the best of ``--repeats`` fresh runs (new inputs, so nothing is cached on the receiver;
best-of rather than median because the 2 cores are shared with other jobs).
The ChainerMN scaling post (docs/references.md) counts effective bandwidth as
``2 L (K-1) / K / time``; ``fraction`` divides it by the p2p bandwidth ``L / time_p2p`` measured
in the same cluster. The last line is one JSON object; its
``calibration`` holds the local constants ``pipeline.averaging.cost`` uses for this machine.

    .venv/bin/python benchmarks/exact.py --repeats 5          # ~3 min on 2 cores
    .venv/bin/python benchmarks/exact.py --sizes 1,10 --replicas 2,4 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

from dask.base import tokenize  # noqa: E402
from distributed import Client, LocalCluster, get_task_stream, wait  # noqa: E402

from pipeline.averaging import exact  # noqa: E402
from pipeline.averaging.reduction import tree_plan, tree_reduce  # noqa: E402

MB = 1_000_000
N_BIG = 16  # large arrays per state (conv/fc weights) ...
N_SMALL = 16  # ... and small ones (biases, BatchNorm statistics), 64 floats each


def make_state(n_bytes: int, value: float) -> dict[str, np.ndarray]:
    """A float32 state dict of ~n_bytes like a model's: 16 big entries, 16 small, an int N."""
    per_big = max(1, (n_bytes - N_SMALL * 64 * 4) // (4 * N_BIG))
    state = {f"/layer{i}/W": np.full(per_big, value + i, np.float32) for i in range(N_BIG)}
    state.update({f"/bn{i}/avg_mean": np.full(64, value, np.float32) for i in range(N_SMALL)})
    state["/bn0/N"] = np.array(7, np.int64)
    return state


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_p2p(client, workers, n_bytes, tag) -> float:
    """Seconds to move an n_bytes state from workers[1] to workers[0] (a fresh one each call)."""
    x = client.submit(make_state, n_bytes, 1.0, workers=[workers[1]], pure=False,
                      key=("make_state-" + tokenize(tag, "p2p")[:8], 0))
    wait(x)
    start = time.perf_counter()
    y = client.submit(exact.nbytes, x, workers=[workers[0]], pure=False,
                      key=("nbytes-" + tokenize(tag, "p2p")[:8], 0))
    wait(y)
    return time.perf_counter() - start


def measure_tree(client, workers, n_bytes, fan_in, tag) -> tuple[float, float, float, float]:
    """(reduce, allreduce, root transfer, root compute) seconds for K = len(workers) states
    already on distinct workers; the last two from the scheduler's task stream."""
    token = tokenize(tag, "tree")[:8]
    states = [client.submit(make_state, n_bytes, float(i), workers=[w], pure=False,
                            key=("make_state-" + token, i)) for i, w in enumerate(workers)]
    wait(states)
    with get_task_stream(client) as stream:
        start = time.perf_counter()
        root = tree_reduce(client, states, exact.combine, exact.finalize,
                           fan_in=fan_in, token=token,
                           combine_finalize=exact.combine_finalize)
        copies = [client.submit(exact.nbytes, root, workers=[w], pure=False,
                                key=("nbytes-" + token, i)) for i, w in enumerate(workers)]
        wait(root)
        reduce_s = time.perf_counter() - start
        wait(copies)
        all_s = time.perf_counter() - start
    spans = {"transfer": [], "compute": []}  # concurrent fetches overlap: take their extent
    for task in stream.data:
        if task["key"] == root.key:
            for span in task["startstops"]:
                spans.get(span["action"], []).append((span["start"], span["stop"]))
    extent = {a: max(e for _, e in s) - min(b for b, _ in s) if s else 0.0
              for a, s in spans.items()}
    return reduce_s, all_s, extent["transfer"], extent["compute"]


def local_costs(n_bytes: int, repeats: int) -> dict[str, float]:
    """Per-byte costs of the averaging arithmetic in this process (one thread, like a worker)."""
    a, b = make_state(n_bytes, 1.0), make_state(n_bytes, 2.0)
    L = exact.nbytes(a)
    raw = min(timed(lambda: exact.combine([a, b])) for _ in range(repeats))
    p = exact.combine([a, b])
    partial = min(timed(lambda: exact.combine([p, p])) for _ in range(repeats))
    fin = min(timed(lambda: exact.finalize(p)) for _ in range(repeats))
    return {"combine_raw_s_per_byte": raw / (2 * L),  # per float32 input byte
            "combine_partial_s_per_byte": partial / (4 * L),  # per float64 input byte
            "finalize_s_per_byte": fin / L}  # per float32 output byte


def run_cluster(k, sizes, fan_ins, repeats):
    """Rows of measurements for one LocalCluster of k workers."""
    rows = []
    # memory_limit=0: no spilling or pausing; a paused worker would stall a tree level for
    # reasons that are not transfer or exact.
    with LocalCluster(n_workers=k, threads_per_worker=1, processes=True, memory_limit=0,
                      dashboard_address=":0", silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        workers = sorted(client.scheduler_info()["workers"])
        for size in sizes:
            n_bytes = int(size * MB)
            measure_p2p(client, workers, n_bytes, ("warm", k, size))  # first touch, discarded
            measure_tree(client, workers, n_bytes, min(fan_ins[0] or k, k), ("warm", k, size))
            fans = sorted({min(f or k, k) for f in fan_ins})
            p2p_runs, tree_runs = [], {f: [] for f in fans}
            for r in range(repeats):  # interleaved, so p2p and trees see the same load
                p2p_runs.append(measure_p2p(client, workers, n_bytes, (k, size, r)))
                for fan_in in fans:
                    tree_runs[fan_in].append(
                        measure_tree(client, workers, n_bytes, fan_in, (k, size, fan_in, r)))
            p2p = min(p2p_runs)
            L = exact.nbytes(make_state(n_bytes, 0.0))
            p2p_bw, moved = L / p2p, 2 * L * (k - 1) / k
            for fan_in, runs in tree_runs.items():
                best = min(runs)  # the least disturbed run, by reduce time
                all_s = min(run[1] for run in runs)
                rows.append(dict(size_mb=size, k=k, fan_in=fan_in,
                                 depth=len(tree_plan(k, fan_in)), bytes=L, p2p_s=p2p,
                                 p2p_gbps=p2p_bw / 1e9, reduce_s=best[0],
                                 reduce_fraction=moved / best[0] / p2p_bw,
                                 root_transfer_s=best[2], root_compute_s=best[3],
                                 allreduce_s=all_s, allreduce_fraction=moved / all_s / p2p_bw))
    return rows


def fit_link(rows) -> dict[str, float]:
    """Least squares t = latency + bytes / bandwidth over the best p2p times of the smallest K
    (the least contended cluster: with 8 worker processes on 2 cores p2p slows down too)."""
    k = min(r["k"] for r in rows)
    seen = {r["size_mb"]: r for r in rows if r["k"] == k}.values()
    x = np.array([r["bytes"] for r in seen], float)
    t = np.array([r["p2p_s"] for r in seen], float)
    slope, intercept = np.polyfit(x, t, 1)
    return {"latency_s": float(intercept), "bandwidth_Bps": float(1 / slope)}


def print_table(rows) -> None:
    print(f"{'MB':>6} {'K':>2} {'fan':>3} {'lvls':>4} {'p2p s':>7} {'p2p GB/s':>8} "
          f"{'reduce s':>9} {'root xfer':>9} {'root avg':>8} "
          f"{'frac':>5} {'allred s':>9} {'frac':>5} {'bound':>5}")
    for r in rows:
        print(f"{r['size_mb']:>6g} {r['k']:>2} {r['fan_in']:>3} {r['depth']:>4} "
              f"{r['p2p_s']:>7.4f} {r['p2p_gbps']:>8.2f} {r['reduce_s']:>9.4f} "
              f"{r['root_transfer_s']:>9.4f} {r['root_compute_s']:>8.4f} "
              f"{r['reduce_fraction']:>5.2f} "
              f"{r['allreduce_s']:>9.4f} {r['allreduce_fraction']:>5.2f} "
              f"{single_host_bound(r['k']):>5.2f}")


def single_host_bound(k: int) -> float:
    """Best fraction any K-way reduce can reach on one host: it moves >= (K-1) L bytes through
    the same cores that move the p2p's L, against the 2L(K-1)/K the formula credits: 2/K."""
    return min(1.0, 2 / k)


def summary(rows, local, link, min_mb: float) -> dict:
    big = [r for r in rows if r["size_mb"] >= min_mb]

    def worst(key, pick=lambda r: True):
        chosen = [r for r in big if pick(r)] or big
        w = min(chosen, key=lambda r: r[key])
        return round(w[key], 3), {"size_mb": w["size_mb"], "k": w["k"], "fan_in": w["fan_in"]}

    frac, where = worst("reduce_fraction", lambda r: r["fan_in"] == 2)
    flat, flat_where = worst("reduce_fraction", lambda r: r["fan_in"] >= r["k"])
    allred, allred_where = worst("allreduce_fraction", lambda r: r["fan_in"] == 2)
    by_k2 = [r["reduce_fraction"] for r in big if r["k"] == 2]
    return {"bench": "averaging", "min_fraction_of_p2p": frac, "worst_case": where,
            "min_fraction_of_p2p_flat": flat, "worst_case_flat": flat_where,
            "min_fraction_of_p2p_allreduce": allred, "worst_case_allreduce": allred_where,
            "min_fraction_k2": round(min(by_k2), 3) if by_k2 else None,
            "single_host_bound": {k: single_host_bound(k) for k in sorted({r["k"] for r in rows})},
            "p2p_gbps_max": round(max(r["p2p_gbps"] for r in rows), 3),
            "target": 0.8, "sizes_mb": sorted({r["size_mb"] for r in rows}),
            "replicas": sorted({r["k"] for r in rows}),
            "calibration": {**{k: float(f"{v:.4g}") for k, v in {**link, **local}.items()},
                            "cpus": os.cpu_count()}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,10,50,100", help="model sizes in MB")
    parser.add_argument("--replicas", default="2,4,8", help="K values (workers), at most 8")
    parser.add_argument("--fan-ins", default="2,0", help="tree fan-ins; 0 means K (one level)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell (best of)")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    ks = [int(k) for k in args.replicas.split(",")]
    if any(k < 2 or k > 8 for k in ks):
        parser.error(f"--replicas must be in 2..8, got {args.replicas}")
    fan_ins = [int(f) for f in args.fan_ins.split(",")]
    load_before = os.getloadavg()[0]
    rows = []
    for k in ks:
        rows += run_cluster(k, sizes, fan_ins, args.repeats)
    local = local_costs(int(max(sizes) * MB), max(5, args.repeats))
    link = fit_link(rows)
    print_table(rows)
    result = summary(rows, local, link, min_mb=2)
    result["loadavg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
