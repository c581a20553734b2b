"""Cost model of a data-parallel round (compute steps plus averaging traffic) and its speedup.

Everything is plain arithmetic on a few measured constants (alpha-beta model: a message of
``b`` bytes over a link costs ``latency + b / bandwidth``). Symbols used below:

    L   model (= gradient) bytes          p   workers (replicas K)       H   local steps per round
    B   link bandwidth, bytes/s            a   link latency, s            f   tree fan-in
    t_s compute time per step = compute_s_per_sample * batch_size
    g_r local reduce cost, s per model byte per input added into the float64 sums
    g_f local finalize cost, s per model byte (divide and cast back)
    c   per-round copies outside the network, s per model byte (GPU<->host, intra-node NCCL)
    tau scheduling cost per task level (Dask: submit -> worker -> done)

Ring allreduce (Patarasuk & Yuan 2009; seed 001's ``N = 2L(p-1)/p``)::

    T_ring(p) = 2(p-1) a + 2(p-1)/p * L/B + (p-1)/p * L g_r + L/p g_f + L c      (0 for p = 1)

Tree of ``average-`` tasks (``pipeline.reduction.tree_reduce``), reduce then broadcast. Level
``l`` has width ``w_l`` (``w_0 = p``, ``w_{l+1} = ceil(w_l / f)``) and widest group
``g_l = min(f, w_l)``; its parent receives ``g_l - 1`` children over its own link. Level-0
children are the float32 states (``L``), higher ones float64 partial sums (``2L``)::

    T_reduce(p) = sum_l [tau + (g_l - 1)(a + b_l/B) + g_l L g_r] + L g_f,   b_0 = L, b_l = 2L
    T_bcast(p)  = (p-1)(a + L/B) + tau            star: every worker fetches from the root
                = ceil(log2 p)(a + L/B) + tau     binomial: holders double each round
    T_tree(p)   = T_reduce(p) + T_bcast(p) + L c

A round is ``H`` steps then one averaging (``gradient`` averages gradients every step, so
``H = 1``); communication is not overlapped with compute::

    T_round(p) = H t_s + T_comm(p)
    speedup(p) = p H t_s / T_round(p)   (images/s over one worker's),  efficiency = speedup / p

>>> w = Workload(compute_s_per_sample=1e-3, batch_size=100, model_bytes=1e8)
>>> round(speedup(w, 8, TEN_GBE, strategy="ipm", H=32), 2)
7.58
"""
from __future__ import annotations

import math
from dataclasses import dataclass

STRATEGIES = ("gradient", "ipm")
ALGORITHMS = ("ring", "tree")
BROADCASTS = ("star", "binomial")


def _check(condition: bool, name: str, message: str, value) -> None:
    if not condition:
        raise ValueError(f"{name} {message}, got {value!r}")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # point-to-point bytes/s one worker sends or receives, as measured
    latency: float = 50e-6  # s per message (MPI over TCP on 10 GbE: tens of microseconds)

    def __post_init__(self):
        _check(self.bandwidth > 0, "link.bandwidth", "must be > 0 bytes/s", self.bandwidth)
        _check(self.latency >= 0, "link.latency", "must be >= 0 s", self.latency)


@dataclass(frozen=True)
class LocalCosts:
    reduce_s_per_byte: float = 0.0  # g_r: add one input's model byte into float64 sums, s/B
    finalize_s_per_byte: float = 0.0  # g_f: divide + cast back, s per model byte
    copy_s_per_byte: float = 0.0  # c: per-round copies off the network (PCIe, NCCL), s/B
    task_s: float = 0.0  # tau: scheduling cost per task level (0 for MPI/NCCL), s

    def __post_init__(self):
        for name in ("reduce_s_per_byte", "finalize_s_per_byte", "copy_s_per_byte", "task_s"):
            _check(getattr(self, name) >= 0, f"local.{name}", "must be >= 0",
                   getattr(self, name))


@dataclass(frozen=True)
class Workload:
    compute_s_per_sample: float  # forward + backward + update, s per sample on one worker
    batch_size: int  # samples per worker per step
    model_bytes: float  # L: bytes of the parameters (= of the gradients)

    def __post_init__(self):
        _check(self.compute_s_per_sample > 0, "workload.compute_s_per_sample", "must be > 0 s",
               self.compute_s_per_sample)
        _check(self.batch_size >= 1, "workload.batch_size", "must be >= 1", self.batch_size)
        _check(self.model_bytes > 0, "workload.model_bytes", "must be > 0", self.model_bytes)

    @property
    def step_s(self) -> float:
        """t_s: seconds per local step."""
        return self.compute_s_per_sample * self.batch_size


# Calibrated on this machine (2-core Xeon VM shared with other jobs, load average 7-9; one-
# thread workers) by
#   .venv/bin/python benchmarks/averaging.py --repeats 5
# (its JSON "calibration", best of 5): averaging.combine of two 100 MB float32 states costs
# 4.5e-10 s per input byte, finalize 7.3e-10 s per output byte; a one-task transfer between
# two local worker processes costs 15 ms + L / 1.08 GB/s, the 15 ms being Dask's per-task
# round trip (tau).
THIS_MACHINE = LocalCosts(reduce_s_per_byte=4.5e-10, finalize_s_per_byte=7.3e-10,
                          task_s=0.015)
LOOPBACK = Link(bandwidth=1.08e9, latency=0.0)  # worker to worker on this host, same run

# Links for the predictions: effective bandwidth is 80% of the line rate, as seed 001 measured
# 8 of 10 Gb/s point to point; latencies are typical of TCP on 10 GbE and of RDMA at 100 Gb/s.
TEN_GBE = Link(bandwidth=8e9 / 8, latency=50e-6)
HUNDRED_GBPS = Link(bandwidth=80e9 / 8, latency=5e-6)

# PCIe 3.0 x16 moves ~12 GB/s in practice (15.75 GB/s theoretical).
PCIE3 = 12e9


def _validate(p: int, name: str = "p") -> None:
    _check(int(p) == p and p >= 1, name, "must be an integer >= 1", p)


def ring_allreduce_time(nbytes: float, p: int, link: Link,
                        local: LocalCosts = LocalCosts()) -> float:
    """Seconds for a bandwidth-optimal ring allreduce of ``nbytes`` over ``p`` workers.

    >>> ring_allreduce_time(1e9, 2, Link(bandwidth=1e9, latency=0.0))
    1.0
    """
    _validate(p)
    if p == 1:
        return 0.0
    frac = (p - 1) / p
    return (2 * (p - 1) * link.latency + 2 * frac * nbytes / link.bandwidth
            + frac * nbytes * local.reduce_s_per_byte + nbytes / p * local.finalize_s_per_byte
            + nbytes * local.copy_s_per_byte)


def tree_widths(p: int, fan_in: int) -> list[int]:
    """Nodes per level below the root of a fan-in-f tree over p inputs (``tree_plan``'s shape).

    >>> tree_widths(7, 2), tree_widths(8, 8), tree_widths(1, 2)
    ([7, 4, 2], [8], [1])
    """
    _validate(p)
    _check(int(fan_in) == fan_in and fan_in >= 2, "fan_in", "must be an integer >= 2", fan_in)
    widths = [p]
    while widths[-1] > fan_in:
        widths.append(math.ceil(widths[-1] / fan_in))
    return widths


def tree_allreduce_time(nbytes: float, p: int, link: Link, local: LocalCosts = LocalCosts(),
                        *, fan_in: int = 2, partial_factor: float = 2.0,
                        broadcast: str = "star") -> float:
    """Seconds for the ``average-`` tree reduce plus the broadcast of the result to all p.

    ``partial_factor``: bytes of a partial sum over bytes of a state (float64 over float32).

    >>> tree_allreduce_time(1e9, 2, Link(bandwidth=1e9, latency=0.0))
    2.0
    """
    _check(broadcast in BROADCASTS, "broadcast", f"must be one of {BROADCASTS}", broadcast)
    if p == 1:
        return 0.0
    total = 0.0
    for level, width in enumerate(tree_widths(p, fan_in)):
        group = min(fan_in, width)
        moved = nbytes * (1.0 if level == 0 else partial_factor)
        total += (local.task_s + (group - 1) * (link.latency + moved / link.bandwidth)
                  + group * nbytes * local.reduce_s_per_byte)
    total += nbytes * local.finalize_s_per_byte
    copies = p - 1 if broadcast == "star" else math.ceil(math.log2(p))
    total += local.task_s + copies * (link.latency + nbytes / link.bandwidth)
    return total + nbytes * local.copy_s_per_byte


def comm_time(nbytes: float, p: int, link: Link, local: LocalCosts = LocalCosts(), *,
              algorithm: str = "ring", fan_in: int = 2, broadcast: str = "star") -> float:
    """Seconds to average ``nbytes`` over ``p`` workers with the named algorithm."""
    _check(algorithm in ALGORITHMS, "algorithm", f"must be one of {ALGORITHMS}", algorithm)
    if algorithm == "ring":
        return ring_allreduce_time(nbytes, p, link, local)
    return tree_allreduce_time(nbytes, p, link, local, fan_in=fan_in, broadcast=broadcast)


def round_time(work: Workload, p: int, link: Link, local: LocalCosts = LocalCosts(), *,
               strategy: str = "ipm", H: int = 1, **comm) -> float:
    """Seconds per round: H local steps then one averaging (``gradient``: H = 1)."""
    _check(strategy in STRATEGIES, "strategy", f"must be one of {STRATEGIES}", strategy)
    _validate(H, "H")
    steps = 1 if strategy == "gradient" else H
    return steps * work.step_s + comm_time(work.model_bytes, p, link, local, **comm)


def speedup(work: Workload, p: int, link: Link, local: LocalCosts = LocalCosts(), *,
            strategy: str = "ipm", H: int = 1, **comm) -> float:
    """Samples/s of p workers over one worker's (which never communicates).

    >>> w = Workload(compute_s_per_sample=1e-3, batch_size=100, model_bytes=1e8)
    >>> speedup(w, 1, TEN_GBE, strategy="gradient")
    1.0
    """
    steps = 1 if strategy == "gradient" else H
    return p * steps * work.step_s / round_time(work, p, link, local, strategy=strategy, H=H,
                                                **comm)


def efficiency(work: Workload, p: int, link: Link, local: LocalCosts = LocalCosts(),
               **kwargs) -> float:
    """speedup / p: the fraction of ideal linear scaling."""
    return speedup(work, p, link, local, **kwargs) / p


# Seed 001 (ChainerMN 1.0, ResNet-50 on ImageNet, 4 Pascal TITAN X per node, 10 GbE):
# allreduce of L = 102,228,384 bytes took 0.15 s on 2 nodes and 0.22 s on 4, with 8 Gb/s
# measured point to point. Its hierarchical communicator reduces over NCCL inside a node,
# copies GPU -> host, runs an MPI allreduce between nodes (summed on the CPU), copies back and
# broadcasts over NCCL: four passes of L over PCIe 3.0 besides the network.
SEED001_BYTES = 102_228_384
SEED001_MEASURED = {2: 0.15, 4: 0.22}
SEED001_LINK = Link(bandwidth=8e9 / 8, latency=50e-6)
SEED001_LOCAL = LocalCosts(reduce_s_per_byte=THIS_MACHINE.reduce_s_per_byte,
                           finalize_s_per_byte=0.0,  # NCCL/MPI sum gradients; no divide pass
                           copy_s_per_byte=4 / PCIE3)


def seed001_check(local: LocalCosts = SEED001_LOCAL, link: Link = SEED001_LINK) -> dict:
    """Predicted vs measured seed-001 allreduce seconds per node count, and relative errors.

    >>> check = seed001_check()
    >>> check["max_rel_error"] < 0.25
    True
    """
    rows = {}
    for nodes, measured in SEED001_MEASURED.items():
        predicted = ring_allreduce_time(SEED001_BYTES, nodes, link, local)
        rows[nodes] = {"measured_s": measured, "predicted_s": predicted,
                       "rel_error": (predicted - measured) / measured}
    return {"nodes": rows, "max_rel_error": max(abs(r["rel_error"]) for r in rows.values())}
