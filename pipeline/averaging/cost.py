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

Ring allreduce (Patarasuk & Yuan 2009; each worker sends and receives ``2L(p-1)/p`` bytes)::

    T_ring(p) = 2(p-1) a + 2(p-1)/p * L/B + (p-1)/p * L g_r + L/p g_f + L c      (0 for p = 1)

Tree of ``average-`` tasks (``pipeline.averaging.reduction.tree_reduce``), reduce then
broadcast. Level ``l`` has width ``w_l`` (``w_0 = p``, ``w_{l+1} = ceil(w_l / f)``) and widest
group ``g_l = min(f, w_l)``; its parent receives ``g_l - 1`` children over its own link. Level-0
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
ALGORITHMS = ("ring", "tree", "sharded", "hierarchical")
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
    gather_s_per_byte: float = 0.0  # g_a: assemble shards into one state (a copy), s per byte
    per_task_s: float = 0.0  # sigma: scheduler time per task of a burst that becomes ready at once
    host_bandwidth: float = math.inf  # B_h: worker to worker inside one host (loopback), bytes/s

    def __post_init__(self):
        for name in ("reduce_s_per_byte", "finalize_s_per_byte", "copy_s_per_byte", "task_s",
                     "gather_s_per_byte", "per_task_s"):
            _check(getattr(self, name) >= 0, f"local.{name}", "must be >= 0",
                   getattr(self, name))
        _check(self.host_bandwidth > 0, "local.host_bandwidth", "must be > 0 bytes/s",
               self.host_bandwidth)


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

# Links for the predictions: effective bandwidth is 80% of the line rate, as ChainerMN 1.0's
# ResNet-50 runs measured 8 of 10 Gb/s point to point (benchmarks/scaling.py); latencies are
# typical of TCP on 10 GbE and of RDMA at 100 Gb/s.
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
                        broadcast: str = "star", hosts: int | None = None) -> float:
    """Seconds for the ``average-`` tree reduce plus the broadcast of the result to all p.

    ``partial_factor``: bytes of a partial sum over bytes of a state (float64 over float32).
    ``hosts``: spread the p workers over this many hosts, as the graph places them on a cluster
    (tree nodes on the worker of their first replica, the binomial broadcast host to host, one
    copy per host); None keeps the one-worker-per-link formula above.

    >>> tree_allreduce_time(1e9, 2, Link(bandwidth=1e9, latency=0.0))
    2.0
    """
    _check(broadcast in BROADCASTS, "broadcast", f"must be one of {BROADCASTS}", broadcast)
    if p == 1:
        return 0.0
    if hosts is not None:
        return _tree_on_hosts(nbytes, p, link, local, fan_in, partial_factor, broadcast, hosts)
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


# ---- algorithms on a cluster of hosts: per-link byte counts from the graph's own placement ---

def model_placement(p: int, hosts: int):
    """p workers over ``hosts`` hosts as evenly as they go, one replica each, placed as the
    graph places them (``pipeline.averaging.placement.place``).

    >>> model_placement(5, 2).replica_host
    (0, 0, 0, 1, 1)
    """
    from pipeline.averaging.placement import place
    _validate(p)
    _check(int(hosts) == hosts and 1 <= hosts <= p, "hosts", f"must be an integer in 1..{p}",
           hosts)
    per = [p // hosts + (1 if h < p % hosts else 0) for h in range(hosts)]
    return place({f"{h:06d}": [f"{h:06d}/{j:06d}" for j in range(n)]
                  for h, n in enumerate(per)}, p)


def _transfer(up: list, down: list, link: Link, local: LocalCosts, one_host: bool) -> float:
    """Seconds of one phase given bytes each host sends and receives: the busiest link, or on a
    single host the loopback carrying all of it."""
    if one_host:
        return sum(up) / local.host_bandwidth
    return link.latency + max(max(up), max(down)) / link.bandwidth


def _shard_hosts(pl, shards: int) -> list[int]:
    """The host (unit) that reduces each shard: shard s on unit s mod units."""
    units = len(pl.units())
    return [s % units if pl.n_hosts > 1 else 0 for s in range(shards)]


def sharded_allreduce_time(nbytes: float, p: int, link: Link, local: LocalCosts = LocalCosts(),
                           *, hosts: int | None = None, shards: int | None = None) -> float:
    """Seconds for the ``sharded`` graph: reduce-scatter then all-gather over ``hosts`` hosts.

    Every replica's shard s (L/S bytes) goes to the worker reducing it, on host s mod H; every
    worker then fetches the S averaged shards. Host h with R_h replicas and S_h shards sends
    ``R_h (S - S_h) L/S`` and receives ``S_h (p - R_h) L/S`` in the first phase, and the reverse
    in the second: ``2 L (p-1)/p`` on every link for one replica per host. Three task levels
    (take, reduce, gather); ``p S + S + p`` tasks.

    >>> round(sharded_allreduce_time(1e9, 4, Link(bandwidth=1e9, latency=0.0)), 3)
    1.5
    """
    _validate(p)
    if p == 1:
        return 0.0
    pl = model_placement(p, hosts or p)
    S = shards or len(pl.units())
    owner = _shard_hosts(pl, S)
    piece = nbytes / S
    R = pl.replicas_per_host()
    S_h = [owner.count(h) for h in range(pl.n_hosts)]
    up = [R[h] * (S - S_h[h]) * piece for h in range(pl.n_hosts)]
    down = [S_h[h] * (p - R[h]) * piece for h in range(pl.n_hosts)]
    one_host = pl.n_hosts == 1
    move = _transfer(up, down, link, local, one_host) + _transfer(down, up, link, local, one_host)
    compute = (max(S_h) * (p * piece * local.reduce_s_per_byte + piece * local.finalize_s_per_byte)
               + nbytes * local.gather_s_per_byte)
    return (3 * local.task_s + (p * S + S + p) * local.per_task_s + move + compute
            + nbytes * local.copy_s_per_byte)


def hierarchical_allreduce_time(nbytes: float, p: int, link: Link,
                                local: LocalCosts = LocalCosts(), *, hosts: int | None = None,
                                fan_in: int = 2, partial_factor: float = 2.0,
                                shards: int | None = None) -> float:
    """Seconds for the ``hierarchical`` graph: each host adds up the largest subtrees of the
    addition order it holds (float64 partials, ``partial_factor`` L each; a lone replica stays
    float32), the hosts reduce-scatter those shard by shard, and each host gathers one copy
    that its other workers read over the loopback.

    >>> net = Link(bandwidth=1e9, latency=0.0)
    >>> hierarchical_allreduce_time(1e9, 4, net) == sharded_allreduce_time(1e9, 4, net)
    True
    """
    from pipeline.averaging.order import Node, build, frontier
    _validate(p)
    if p == 1:
        return 0.0
    pl = model_placement(p, hosts or p)
    root = build(p, fan_in)
    nodes = [frontier(root, pl.replicas_on(h)) for h in range(pl.n_hosts)]
    partials = [[n for n in host if isinstance(n, Node)] for host in nodes]
    local_s = [sum((n.stop - n.first - 1) * nbytes / local.host_bandwidth
                   + (n.stop - n.first) * nbytes * local.reduce_s_per_byte for n in host)
               for host in partials]
    levels = 1 if any(partials) else 0
    if pl.n_hosts == 1:  # the whole tree on one host, read by its workers
        fetch = (len(pl.hosts[0]) - 1) * nbytes / local.host_bandwidth
        return (levels * local.task_s + len(partials[0]) * local.per_task_s + max(local_s)
                + nbytes * local.finalize_s_per_byte + fetch + nbytes * local.copy_s_per_byte)
    sizes = [sum(partial_factor * nbytes if isinstance(n, Node) else nbytes for n in host)
             for host in nodes]
    S = shards or pl.n_hosts
    owner = _shard_hosts(pl, S)
    S_h = [owner.count(h) for h in range(pl.n_hosts)]
    up = [sizes[h] * (S - S_h[h]) / S for h in range(pl.n_hosts)]
    down = [S_h[h] / S * (sum(sizes) - sizes[h]) for h in range(pl.n_hosts)]
    gather_up = [S_h[h] * nbytes / S * (pl.n_hosts - 1) for h in range(pl.n_hosts)]
    gather_down = [(S - S_h[h]) * nbytes / S for h in range(pl.n_hosts)]
    inputs = sum(len(host) for host in nodes)
    compute = (max(S_h) * nbytes / S * (inputs * local.reduce_s_per_byte
                                        + local.finalize_s_per_byte)
               + nbytes * local.gather_s_per_byte)
    fetch = max(len(w) - 1 for w in pl.hosts) * nbytes / local.host_bandwidth
    tasks = sum(map(len, partials)) + inputs * S + S + pl.n_hosts
    return ((levels + 3) * local.task_s + tasks * local.per_task_s + max(local_s)
            + _transfer(up, down, link, local, False)
            + _transfer(gather_up, gather_down, link, local, False) + compute + fetch
            + nbytes * local.copy_s_per_byte)


def _tree_on_hosts(nbytes, p, link, local, fan_in, partial_factor, broadcast, hosts) -> float:
    """The tree with nodes on their first replica's worker, levels one after another; the
    binomial broadcast copies host to host (one task level per doubling), the star sends
    every remote replica its own copy from the root."""
    from pipeline.averaging.order import Node, build, span
    pl = model_placement(p, hosts)
    root = build(p, fan_in)
    by_level: dict[int, float] = {}

    def visit(node) -> None:
        remote = local_bytes = 0.0
        for child in node.children:
            if isinstance(child, Node):
                visit(child)
            moved = partial_factor * nbytes if isinstance(child, Node) else nbytes
            first = span(child)[0]
            if pl.replica_worker[first] == pl.replica_worker[node.first]:
                continue
            if pl.replica_host[first] == pl.replica_host[node.first]:
                local_bytes += moved
            else:
                remote += moved
        seconds = (remote / link.bandwidth + (link.latency if remote else 0.0)
                   + local_bytes / local.host_bandwidth
                   + len(node.children) * nbytes * local.reduce_s_per_byte)
        by_level[node.level] = max(by_level.get(node.level, 0.0), seconds)
    visit(root)
    total = sum(local.task_s + s for s in by_level.values()) + nbytes * local.finalize_s_per_byte
    fetch = max(len(w) - 1 for w in pl.hosts) * nbytes / local.host_bandwidth
    if broadcast == "star":
        remote = p - len(pl.replicas_on(0))
        total += local.task_s + remote * (link.latency + nbytes / link.bandwidth) + fetch
    else:
        steps = math.ceil(math.log2(pl.n_hosts)) if pl.n_hosts > 1 else 0
        total += steps * (local.task_s + link.latency + nbytes / link.bandwidth) + fetch
    return total + nbytes * local.copy_s_per_byte


def shard_counts(hosts: int) -> list[int]:
    """The shard counts worth trying for ``hosts`` hosts: H, ceil(H/2), ceil(H/4) ... 1.

    >>> shard_counts(6)
    [6, 3, 2, 1]
    """
    counts, s = [], hosts
    while True:
        counts.append(s)
        if s == 1:
            return counts
        s = math.ceil(s / 2)


def best_shards(nbytes: float, p: int, link: Link, local: LocalCosts = LocalCosts(), *,
                algorithm: str = "sharded", hosts: int | None = None,
                fan_in: int = 2) -> tuple[int, float]:
    """``(S, seconds)`` of the fastest shard count: fewer shards than hosts move more bytes
    through the reducing hosts but submit fewer tasks (``p S`` takes for ``sharded``), which
    pays once ``per_task_s`` outweighs the bytes (hundreds of workers)."""
    units = hosts or p
    if algorithm == "sharded" and units == 1:
        units = p  # one host: a shard per worker
    kw = {"fan_in": fan_in} if algorithm == "hierarchical" else {}
    times = {s: comm_time(nbytes, p, link, local, algorithm=algorithm, hosts=hosts, shards=s, **kw)
             for s in shard_counts(units)}
    best = min(times, key=times.get)
    return best, times[best]


def comm_time(nbytes: float, p: int, link: Link, local: LocalCosts = LocalCosts(), *,
              algorithm: str = "ring", fan_in: int = 2, broadcast: str = "star",
              hosts: int | None = None, shards: int | None = None) -> float:
    """Seconds to average ``nbytes`` over ``p`` workers with the named algorithm.

    ``hosts``: the p workers' hosts (default: one worker per host); ``shards``: S of the
    sharded algorithms (default: one per host)."""
    _check(algorithm in ALGORITHMS, "algorithm", f"must be one of {ALGORITHMS}", algorithm)
    if algorithm == "ring":
        return ring_allreduce_time(nbytes, p, link, local)
    if algorithm == "sharded":
        return sharded_allreduce_time(nbytes, p, link, local, hosts=hosts, shards=shards)
    if algorithm == "hierarchical":
        return hierarchical_allreduce_time(nbytes, p, link, local, hosts=hosts, fan_in=fan_in,
                                           shards=shards)
    return tree_allreduce_time(nbytes, p, link, local, fan_in=fan_in, broadcast=broadcast,
                               hosts=hosts)


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
