"""Benchmark: pipeline.averaging.cost against ChainerMN's measured allreduce, and its speedup
predictions to 256 workers.

Prints the ChainerMN allreduce check (the JSON keeps its ``seed001_*`` keys, as recorded in
docs/cost.md), then a markdown table per link of predicted speedup for
``gradient`` (average gradients every step) and ``ipm`` at H = 8 and 32, each with a ring
allreduce and with our ``average-`` tree (fan-in 2, float64 partials) followed by either the
star broadcast the graph does now (every worker fetches the result from the root) or a
binomial one; writes the plot to ``docs/cost.png`` and ends with one JSON line.

    .venv/bin/python benchmarks/cost.py            # < 5 s, no cluster

Workload: ResNet-50 (ChainerMN's measured 102,228,384 gradient bytes = 25.6 M float32
parameters), 32 images per worker per step as in those ChainerMN runs, and 1/367 s per image:
NVIDIA's DeepLearningExamples ResNet-50 v1.5 (PyTorch) README reports 367 img/s FP32 training
on one V100 16 GB (DGX-1). Local terms are this machine's calibrated NumPy averaging
(``cost.THIS_MACHINE``) plus one GPU -> host and one host -> GPU copy of L per round over
PCIe 3.0; the tree adds Dask's per-level task cost, the ring none (an MPI/NCCL collective).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.averaging import cost  # noqa: E402
from pipeline.averaging.cost import (HUNDRED_GBPS, PCIE3, TEN_GBE, Link, LocalCosts,  # noqa: E402
                                     Workload, ring_allreduce_time, speedup)

# ChainerMN 1.0, ResNet-50 on ImageNet, 4 Pascal TITAN X per node, 10 GbE: an allreduce of
# L = 102,228,384 bytes took 0.15 s on 2 nodes and 0.22 s on 4, with 8 Gb/s measured point to
# point. Its hierarchical communicator reduces over NCCL inside a node, copies GPU -> host, runs
# an MPI allreduce between nodes (summed on the CPU), copies back and broadcasts over NCCL: four
# passes of L over PCIe 3.0 besides the network.
CHAINERMN_BYTES = 102_228_384
CHAINERMN_MEASURED = {2: 0.15, 4: 0.22}  # nodes -> seconds per allreduce
CHAINERMN_LINK = Link(bandwidth=8e9 / 8, latency=50e-6)
CHAINERMN_LOCAL = LocalCosts(reduce_s_per_byte=cost.THIS_MACHINE.reduce_s_per_byte,
                             finalize_s_per_byte=0.0,  # NCCL/MPI sum gradients; no divide pass
                             copy_s_per_byte=4 / PCIE3)

V100_FP32_IMAGES_PER_S = 367  # DeepLearningExamples RN50 v1.5 PyTorch, 1x V100 16GB, FP32
RESNET50 = Workload(compute_s_per_sample=1 / V100_FP32_IMAGES_PER_S, batch_size=32,
                    model_bytes=CHAINERMN_BYTES)
RING_LOCAL = replace(cost.THIS_MACHINE, copy_s_per_byte=2 / PCIE3, task_s=0.0)
TREE_LOCAL = replace(cost.THIS_MACHINE, copy_s_per_byte=2 / PCIE3)
LINKS = {"10GbE": TEN_GBE, "100Gb/s": HUNDRED_GBPS}
SERIES = {"gradient": dict(strategy="gradient", H=1), "ipm H=8": dict(strategy="ipm", H=8),
          "ipm H=32": dict(strategy="ipm", H=32)}
# "tree/star" is the graph as built: every worker fetches the averaged state from the root.
# "tree/binomial" is the same reduce with a doubling broadcast (holders copy onward).
ALGOS = {"ring": dict(algorithm="ring"),
         "tree/star": dict(algorithm="tree", fan_in=2, broadcast="star"),
         "tree/binomial": dict(algorithm="tree", fan_in=2, broadcast="binomial")}
WORKERS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# The averaging algorithms of pipeline/averaging_algorithms across hosts, each with the shard
# count the model finds fastest (cost.best_shards; a shard per host until the task count
# costs more than the bytes). "per host": one worker per host and link, as above; "4/host":
# ChainerMN's nodes, four workers sharing a host's link, the tree's fan-in 4 matching them.
HOSTED = {"tree/binomial": dict(algorithm="tree", broadcast="binomial"),
          "sharded": dict(algorithm="sharded"), "hierarchical": dict(algorithm="hierarchical")}
PER_HOST = {"1/host": 1, "4/host": 4}


def chainermn_check(local: LocalCosts = CHAINERMN_LOCAL, link: Link = CHAINERMN_LINK) -> dict:
    """Predicted vs measured ChainerMN allreduce seconds per node count, and relative errors."""
    rows = {}
    for nodes, measured in CHAINERMN_MEASURED.items():
        predicted = ring_allreduce_time(CHAINERMN_BYTES, nodes, link, local)
        rows[nodes] = {"measured_s": measured, "predicted_s": predicted,
                       "rel_error": (predicted - measured) / measured}
    return {"nodes": rows, "max_rel_error": max(abs(r["rel_error"]) for r in rows.values())}


def hosted(link, series, algo, p, per_host) -> tuple[float, int | None]:
    """(speedup, shards) of one of our algorithms with ``per_host`` workers per host."""
    hosts = max(1, p // per_host)
    kw = dict(HOSTED[algo], fan_in=4 if per_host > 1 else 2, hosts=hosts)
    shards = None
    if algo != "tree/binomial":
        shards, _ = cost.best_shards(RESNET50.model_bytes, p, link, TREE_LOCAL,
                                        algorithm=kw["algorithm"], hosts=hosts,
                                        fan_in=kw["fan_in"])
        kw["shards"] = shards
    return speedup(RESNET50, p, link, TREE_LOCAL, **SERIES[series], **kw), shards


def hosted_table(link_name: str, per_host: str) -> str:
    link, n = LINKS[link_name], PER_HOST[per_host]
    cols = [(s, a) for a in HOSTED for s in SERIES]
    lines = [f"Speedup over one worker with our averaging graphs, {link_name}, {per_host} "
             "(S: shards the model picks):", "",
             "| workers | " + " | ".join(f"{s} ({a})" for s, a in cols) + " | S |",
             "|---:|" + "---:|" * (len(cols) + 1)]
    for p in WORKERS:
        if p < n:
            continue
        cells = [hosted(link, s, a, p, n) for s, a in cols]
        lines.append(f"| {p} | " + " | ".join(f"{v:.1f}" for v, _ in cells)
                     + f" | {cells[-1][1]} |")
    return "\n".join(lines)


def predict(link, series, algo, p) -> float:
    local = RING_LOCAL if algo == "ring" else TREE_LOCAL
    return speedup(RESNET50, p, link, local, **SERIES[series], **ALGOS[algo])


def table(link_name: str) -> str:
    link = LINKS[link_name]
    cols = [(s, a) for a in ALGOS for s in SERIES]
    lines = [f"Speedup over one worker, {link_name} "
             f"({link.bandwidth * 8 / 1e9:g} Gb/s effective, {link.latency * 1e6:g} us):", "",
             "| workers | " + " | ".join(f"{s} ({a})" for s, a in cols) + " |",
             "|---:|" + "---:|" * len(cols)]
    for p in WORKERS:
        lines.append(f"| {p} | " + " | ".join(f"{predict(link, s, a, p):.1f}" for s, a in cols)
                     + " |")
    return "\n".join(lines)


def plot(path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for ax, (name, link) in zip(axes, LINKS.items()):
        ax.plot(WORKERS, WORKERS, "-", color="0.75", linewidth=3, label="linear")
        for color, series in zip(("C0", "C1", "C2"), SERIES):
            for style, algo in zip(("-", ":", "--"), ALGOS):
                ax.plot(WORKERS, [predict(link, series, algo, p) for p in WORKERS], style,
                        color=color, marker="o", markersize=3, label=f"{series} ({algo})")
        ax.set(xscale="log", yscale="log", xlabel="workers", title=f"ResNet-50, {name}")
        ax.set_xticks(WORKERS, [str(p) for p in WORKERS])
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("speedup (images/s over one worker)")
    axes[1].legend(fontsize=7, loc="upper left")
    fig.suptitle("pipeline.averaging.cost: V100 FP32 367 img/s, 32 img/worker/step, L = 102 MB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", default="docs/cost.png",
                        help="where the PNG goes, relative to the repository ('' for none)")
    args = parser.parse_args(argv)

    check = chainermn_check()
    print("ChainerMN allreduce (ring, 8 Gb/s, hierarchical copies over PCIe 3.0):")
    for nodes, row in check["nodes"].items():
        print(f"  {nodes} nodes: measured {row['measured_s']:.3f} s, predicted "
              f"{row['predicted_s']:.3f} s ({row['rel_error']:+.1%})")
    bare = chainermn_check(local=LocalCosts())
    print(f"  network term alone: max error {bare['max_rel_error']:.1%}")
    print(f"Workload: {RESNET50}; step {RESNET50.step_s * 1e3:.1f} ms")
    print(f"Local costs: ring {RING_LOCAL}\n             tree {TREE_LOCAL}\n")
    for name in LINKS:
        print(table(name) + "\n")
    for name in LINKS:
        for per_host in PER_HOST:
            print(hosted_table(name, per_host) + "\n")
    if args.plot:
        plot(REPO / args.plot)
        print(f"plot: {args.plot}")
    at = {name: {f"{s} ({a})": round(predict(link, s, a, 256), 2) for a in ALGOS for s in SERIES}
          for name, link in LINKS.items()}
    for name, link in LINKS.items():
        at[name].update({f"{s} ({a}, {ph})": round(hosted(link, s, a, 256, n)[0], 2)
                         for ph, n in PER_HOST.items() for a in HOSTED for s in SERIES})
    result = {"bench": "scaling", "seed001_max_rel_error": round(check["max_rel_error"], 4),
              "seed001": {str(n): {k: round(v, 4) for k, v in row.items()}
                          for n, row in check["nodes"].items()},
              "seed001_network_only_max_rel_error": round(bare["max_rel_error"], 4),
              "compute_s_per_sample": RESNET50.compute_s_per_sample,
              "batch_size": RESNET50.batch_size, "model_bytes": RESNET50.model_bytes,
              "speedup_at_256": at,
              "efficiency_at_256": {n: {k: round(v / 256, 3) for k, v in d.items()}
                                    for n, d in at.items()},
              "plot": args.plot or None}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
