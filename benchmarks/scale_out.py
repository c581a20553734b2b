"""Benchmark: averaging across emulated hosts on rate-capped links, per algorithm, and whole ipm
rounds against ``pipeline.averaging.cost``'s prediction for the same cluster.

For each host count H (``--hosts 2,4,8``) this starts H emulated hosts (``pipeline.cluster.emulated``:
network namespaces, one ``dask worker`` each, every link capped at ``--rate`` each way by tbf)
and, from the head namespace where the scheduler runs:

- p2p: one state of ``--mb`` MB from host 0's worker to host 1's: the link's TCP goodput;
- allreduce, per algorithm: H fresh states (one replica per host, made on their workers), from
  submitting the average until every replica's worker holds the mean. Effective bandwidth is
  ``2 L (K-1)/K / time`` (the ChainerMN scaling post's count, docs/references.md) over the link
  rate; beside it the time ``pipeline.averaging.cost.comm_time`` predicts from the measured p2p
  link;
- cpu: while each allreduce runs, the CPU seconds of all the run's processes (workers,
  scheduler, driver; the kernel's veth/bridge/tbf work is charged to them) per second, and the
  whole machine's busy fraction: well under the 2 cores means the links are the bottleneck;
- ipm: ``pipeline.train`` with ``wide-mlp`` (a 100.9 MB state), K = H replicas, ``--average``
  of ``--round-average`` (default ``auto``, which picks ``sharded`` here), ``--steps`` local steps
  per round; the median seconds of the rounds between the first (initial broadcast) and the
  last (evaluation, final gather). A one-replica run on the same cluster gives the compute time
  of a round; the prediction is that compute, stretched by K replicas sharing the machine's
  cores, plus the one-replica run's fixed per-round cost, plus the predicted averaging.

The last line is one JSON object: ``min_fraction_of_link`` (best algorithm at the worst host
count), ``model_max_rel_error`` (ipm rounds), per-host-count figures. Needs root and iproute2.

    flock /work/cpu.lock .venv/bin/python benchmarks/scale_out.py            # ~20 min
    .venv/bin/python benchmarks/scale_out.py --hosts 2 --mb 20 --rounds 4    # ~1 min
    # the same in three shorter exclusive sections (about 4, 7 and 8+ min), then one summary:
    for h in 2 4 8; do flock /work/cpu.lock .venv/bin/python benchmarks/scale_out.py \
        --hosts $h --save /tmp/scale_out-$h.json; done
    .venv/bin/python benchmarks/scale_out.py --merge /tmp/scale_out-{2,4,8}.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.cluster import emulated  # noqa: E402

ALGORITHMS = ("tree", "sharded", "hierarchical")
MB = 1_000_000


# ---- inside the head namespace ------------------------------------------------------------------

def make_state(n_bytes: int, value: float) -> dict:
    """A float32 state of ~n_bytes in 16 entries (a model's big weights)."""
    import numpy as np
    per = max(1, n_bytes // (4 * 16))
    return {f"/layer{i}/W": np.full(per, value + i, np.float32) for i in range(16)}


def nbytes(state) -> int:
    return int(sum(v.nbytes for v in state.values()))


def _proc_cpu_s(run: str) -> float:
    """CPU seconds (user + system) used so far by the processes of emulated run ``run``."""
    total, marker = 0, f"DCP_EMULATED_RUN={run}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if marker not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _machine_busy() -> tuple[int, int]:
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


class CpuMeter:
    """CPU of the run's processes (cores busy) and of the machine (fraction) over a window."""

    def __init__(self, run: str):
        self.run = run

    def __enter__(self):
        self.t0, self.p0, self.m0 = time.perf_counter(), _proc_cpu_s(self.run), _machine_busy()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.cores = (_proc_cpu_s(self.run) - self.p0) / self.seconds
        m1 = _machine_busy()
        self.machine = (m1[0] - self.m0[0]) / max(1, m1[1] - self.m0[1])


def measure_p2p(client, src: str, dst: str, n_bytes: int, tag: str) -> float:
    from distributed import wait
    x = client.submit(make_state, n_bytes, 1.0, workers=[src], pure=False,
                      key=(f"make_state-{tag}", 0))
    wait(x)
    start = time.perf_counter()
    y = client.submit(nbytes, x, workers=[dst], pure=False, key=(f"nbytes-{tag}", 0))
    wait(y)
    return time.perf_counter() - start


def identity(x):
    return x


def per_task_s(client, workers, n: int = 400) -> float:
    """Seconds per task of a burst of n tiny tasks that become ready at once, spread over the
    workers (as an average's take tasks): the scheduler's cost per task, sigma."""
    from distributed import wait
    seeds = [client.submit(identity, i, workers=[w], pure=False, key=(f"seed-{0xa0:08x}", i))
             for i, w in enumerate(workers)]
    wait(seeds)
    start = time.perf_counter()
    burst = [client.submit(identity, seeds[i % len(seeds)], pure=False,
                           key=(f"burst-{0xa1:08x}", i)) for i in range(n)]
    wait(burst)
    return (time.perf_counter() - start) / n


def measure_allreduce(client, name: str, placement, n_bytes: int, fan_in: int, run: str,
                      tag: str) -> dict:
    from distributed import wait

    from pipeline.averaging import algorithms
    from pipeline.averaging.algorithms import Context
    k = placement.n_replicas
    states = [client.submit(make_state, n_bytes, float(i), workers=[placement.replica_worker[i]],
                            pure=False, key=(f"make_state-{tag}", i)) for i in range(k)]
    wait(states)
    ctx = Context(client, "average", tag, (0,), fan_in, placement, placement.n_hosts, k)
    with CpuMeter(run) as cpu:
        copies = algorithms.get(name).allreduce(ctx, states)
        wait(copies)
    del copies, states
    return {"s": cpu.seconds, "cpu_cores": cpu.cores, "machine_busy": cpu.machine}


def ipm_rounds(client, replicas: int, algorithm: str, steps: int, batch: int, rounds: int,
               fan_in: int) -> dict:
    """Per-round seconds of an ipm run with wide-mlp, and its train compute per round."""
    from pipeline import Config, train
    images = replicas * steps * batch * rounds
    cfg = Config().replace(**{
        "data.source": f"synthetic:{images}:{batch}", "model.name": "wide-mlp",
        "train.strategy": "ipm", "train.replicas": replicas, "train.batch_size": batch,
        "train.epochs": 1, "train.optimizer": "momentum", "train.lr": 0.01,
        "average.mix_every": str(steps), "average.algorithm": algorithm, "average.fan_in": fan_in,
        "augment.policy": "none", "checkpoint_every": 0, "progress": False, "seed": 0})
    logs: list[str] = []
    out = train(cfg, client=client, log=logs.append)
    ends = [line["seconds"] for line in out.history]
    periods = [b - a for a, b in zip(ends, ends[1:])][:-1]  # rounds 1 .. n-2
    train_s = [line["stage_seconds"]["train"] / replicas for line in out.history[1:-1]]
    return {"round_s": statistics.median(periods), "rounds_s": [round(p, 3) for p in periods],
            "train_s": statistics.median(train_s), "log": [m for m in logs if "average" in m],
            "state_bytes": out.history[0]["bytes_averaged"] // replicas}


def inner(args) -> None:
    """Everything that talks to the cluster; runs in the head namespace."""
    import numpy as np
    from distributed import Client

    from pipeline.averaging import algorithms
    from pipeline.averaging import cost
    from pipeline.averaging.placement import place
    run = os.environ["DCP_EMULATED_RUN"]
    n_bytes = int(args.mb * MB)
    with Client(args.scheduler) as client:
        hosts = algorithms.workers_by_host(client)
        placement = place(hosts, sum(map(len, hosts.values())))  # a replica per worker
        k, workers = placement.n_replicas, placement.replica_worker
        src, dst = placement.host_worker(0), placement.host_worker(1)  # two hosts
        measure_p2p(client, src, dst, n_bytes, "0000000a")  # first touch
        p2p = min(measure_p2p(client, src, dst, n_bytes, f"{i + 11:08x}")
                  for i in range(args.repeats))
        bytes_ = nbytes(make_state(n_bytes, 0.0))
        link = cost.Link(bandwidth=bytes_ / p2p, latency=0.0)
        a, b = make_state(n_bytes, 0.0), make_state(n_bytes, 1.0)
        start = time.perf_counter()
        for key in a:
            np.concatenate([a[key], b[key]])
        gather_s = (time.perf_counter() - start) / (2 * bytes_)
        sigma = per_task_s(client, workers)
        local = cost.LocalCosts(**{**vars(cost.THIS_MACHINE),
                                      "gather_s_per_byte": gather_s, "per_task_s": sigma,
                                      "host_bandwidth": cost.LOOPBACK.bandwidth})
        rows, tags = {}, iter(range(0x100, 0x10000))
        for name in args.algorithms.split(","):
            runs = [measure_allreduce(client, name, placement, n_bytes, args.fan_in, run,
                                      f"{next(tags):08x}") for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["s"])
            extra = {"broadcast": "binomial"} if name == "tree" else {}
            predicted = cost.comm_time(bytes_, k, link, local, algorithm=name,
                                          fan_in=args.fan_in, hosts=placement.n_hosts, **extra)
            rows[name] = {**best, "predicted_s": predicted}
        result = {"hosts": placement.n_hosts, "replicas": k, "bytes": bytes_, "p2p_s": p2p,
                  "p2p_Bps": bytes_ / p2p, "per_task_s": sigma, "gather_s_per_byte": gather_s,
                  "allreduce": rows}
        if args.rounds:
            solo = ipm_rounds(client, 1, "tree", args.steps, args.batch, args.rounds, args.fan_in)
            many = ipm_rounds(client, k, args.round_average, args.steps, args.batch, args.rounds,
                              args.fan_in)
            chosen = many["log"][0].split(":", 1)[1].split(",")[0].strip() if many["log"] \
                else args.round_average
            cores = os.cpu_count() or 1
            share = max(1.0, k / cores)  # K one-thread workers on the machine's cores
            overhead = max(0.0, solo["round_s"] - solo["train_s"])
            predicted = (solo["train_s"] * share + overhead
                         + cost.comm_time(many["state_bytes"], k, link, local,
                                             algorithm=chosen, fan_in=args.fan_in,
                                             hosts=placement.n_hosts))
            result["ipm"] = {"algorithm": chosen, "state_bytes": many["state_bytes"],
                             "measured_s": many["round_s"],
                             "rounds_s": many["rounds_s"], "predicted_s": predicted,
                             "train_s": many["train_s"], "solo_round_s": solo["round_s"],
                             "solo_train_s": solo["train_s"], "cpu_share": share}
    print(json.dumps(result), flush=True)


# ---- the driver in the root namespace -----------------------------------------------------------

def run_hosts(args, hosts: int) -> dict:
    rate = emulated.parse_rate(args.rate)
    with emulated.emulated_cluster(hosts, rate, workers_per_host=args.workers_per_host) as cluster:
        argv = [sys.executable, __file__, "--inner", "--scheduler", cluster.scheduler_address,
                "--mb", str(args.mb), "--algorithms", args.algorithms, "--repeats",
                str(args.repeats), "--fan-in", str(args.fan_in), "--rounds", str(args.rounds),
                "--steps", str(args.steps), "--batch", str(args.batch), "--round-average",
                args.round_average]
        done = cluster.run_in_head(argv, timeout=3600, cwd=str(REPO))
    if done.returncode != 0:
        raise SystemExit(f"error: the measurement on {hosts} hosts failed: "
                         f"{done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["rate_Bps"] = rate / 8
    return result


def summarise(results: list[dict], args) -> dict:
    fractions, model, cpu = {}, {}, {}
    for r in results:
        k, moved = r["hosts"], 2 * r["bytes"] * (r["replicas"] - 1) / r["replicas"]
        for name, row in r["allreduce"].items():
            fractions.setdefault(name, {})[k] = round(moved / row["s"] / r["rate_Bps"], 3)
            model.setdefault(name, {})[k] = round((row["predicted_s"] - row["s"]) / row["s"], 3)
            cpu.setdefault(name, {})[k] = round(row["cpu_cores"], 3)
    # a host count may have run only some algorithms (--algorithms): best of those it ran
    counts = sorted({k for f in fractions.values() for k in f})
    best = {k: max(f[k] for f in fractions.values() if k in f) for k in counts}
    worst_k = min(best, key=best.get)
    ipm = {r["hosts"]: r["ipm"] for r in results if "ipm" in r}
    ipm_err = {k: round((v["predicted_s"] - v["measured_s"]) / v["measured_s"], 3)
               for k, v in ipm.items()}
    return {"bench": "scale_out", "rate_mbit": results[0]["rate_Bps"] * 8 / 1e6,
            "state_mb": round(results[0]["bytes"] / MB, 1),
            "min_fraction_of_link": best[worst_k],
            "worst_case": {"hosts": worst_k,  # keys below are host counts
                           "algorithm": max((n for n in fractions if worst_k in fractions[n]),
                                         key=lambda n: fractions[n][worst_k])},
            "sharded_min_fraction": min(fractions["sharded"].values())
            if "sharded" in fractions else None,
            "model_max_rel_error": max(map(abs, ipm_err.values())) if ipm_err else None,
            "ipm_rel_error": ipm_err,
            "ipm_round_s": {k: round(v["measured_s"], 2) for k, v in ipm.items()},
            "ipm_predicted_s": {k: round(v["predicted_s"], 2) for k, v in ipm.items()},
            "allreduce_model_max_rel_error": max(abs(e) for m in model.values()
                                                 for e in m.values()),
            "fraction_of_link": fractions, "allreduce_model_rel_error": model,
            "cpu_cores_busy": cpu,
            "machine_busy_max": max(row["machine_busy"] for r in results
                                    for row in r["allreduce"].values()),
            "p2p_fraction_of_link": {r["hosts"]: round(r["p2p_Bps"] / r["rate_Bps"], 3)
                                     for r in results},
            "per_task_s": {r["hosts"]: round(r["per_task_s"], 6) for r in results},
            "replicas": {r["hosts"]: r["replicas"] for r in results},
            "loadavg_1min": {r["hosts"]: r.get("loadavg_1min") for r in results},
            "targets": {"sharded_fraction": 0.8, "model_rel_error": 0.25},
            "cpus": os.cpu_count()}


def print_table(results: list[dict]) -> None:
    print(f"{'hosts':>5} {'algorithm':>12} {'seconds':>8} {'predicted':>9} {'fraction':>8} "
          f"{'cpu cores':>9} {'machine':>7}")
    for r in results:
        moved = 2 * r["bytes"] * (r["replicas"] - 1) / r["replicas"]
        for name, row in r["allreduce"].items():
            print(f"{r['hosts']:>5} {name:>12} {row['s']:>8.2f} {row['predicted_s']:>9.2f} "
                  f"{moved / row['s'] / r['rate_Bps']:>8.3f} {row['cpu_cores']:>9.3f} "
                  f"{row['machine_busy']:>7.2f}")
        if "ipm" in r:
            i = r["ipm"]
            print(f"{r['hosts']:>5} {'ipm round':>12} {i['measured_s']:>8.2f} "
                  f"{i['predicted_s']:>9.2f}   ({i['algorithm']}; train {i['train_s']:.2f} s, "
                  f"one replica {i['solo_train_s']:.2f} s x {i['cpu_share']:g})")


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="2,4,8", help="host counts")
    p.add_argument("--workers-per-host", type=int, default=1,
                   help="one-thread workers per host, a replica each (match --fan-in to them)")
    p.add_argument("--rate", default="100mbit", help="tbf rate of every link, each way")
    p.add_argument("--mb", type=float, default=100.0, help="state size in MB")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--repeats", type=int, default=1, help="allreduce runs per algorithm (best)")
    p.add_argument("--fan-in", type=int, default=4, help="of the addition order (the tree)")
    p.add_argument("--rounds", type=int, default=5, help="ipm rounds per run (0: no ipm)")
    p.add_argument("--steps", type=int, default=2, help="local steps per ipm round")
    p.add_argument("--batch", type=int, default=16, help="images per step per replica")
    p.add_argument("--round-average", default="auto", help="--average of the ipm runs")
    p.add_argument("--save", help="also write this run's per-host results to this JSON file")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="summarise results saved by --save (runs nothing): one exclusive-lock "
                        "section per host count instead of one long one")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scheduler", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        inner(args)
        return None
    if args.merge:
        results = [r for path in args.merge for r in json.loads(Path(path).read_text())]
        print_table(results)
        summary = summarise(results, args)
        print(json.dumps(summary), flush=True)
        return summary
    if args.rounds and args.rounds < 4:
        p.error("--rounds must be 0 or >= 4 (the first and last rounds are not timed)")
    reason = emulated.skip_reason()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        raise SystemExit(2)
    load = os.getloadavg()[0]
    results = [run_hosts(args, int(h)) for h in args.hosts.split(",")]
    for r in results:
        r["loadavg_1min"] = round(load, 2)
    if args.save:
        Path(args.save).write_text(json.dumps(results))
    print_table(results)
    summary = summarise(results, args)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
