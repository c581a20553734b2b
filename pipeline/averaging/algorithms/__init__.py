"""Averaging algorithms: how the replicas' mean is computed and handed back to them, as Dask graphs.

One module per algorithm (``tree``, ``gather``, ``sharded``, ``hierarchical``), each with three functions
of a :class:`~pipeline.averaging.algorithms.base.Context` (client, keys, placement):

- ``allreduce(ctx, payloads) -> [future per replica]``: the mean, where each replica will read it;
- ``reduce(ctx, payloads) -> future``: the mean on replica 0's worker (outer step, gradient
  update, mixture's evaluation);
- ``broadcast(ctx, value) -> [future per replica]``: a value on replica 0's worker, to all.

They differ in where bytes go, never in the result: all add the same float64 numbers in the
same order (``pipeline.averaging.order``) and divide once, so the averaged state is identical bit
for bit whatever the algorithm, the shard count and the placement. :func:`plan` picks one for
the cluster it sees (``auto``: on one host ``gather`` for two workers, the tree for more; else ``pipeline.averaging.cost``'s fastest) and
places the replicas (``pipeline.averaging.placement``). A new algorithm is one module plus one line here.
"""
from __future__ import annotations

from typing import NamedTuple

from pipeline.averaging import cost
from pipeline.averaging.algorithms import gather, hierarchical, sharded, tree
from pipeline.averaging.algorithms.base import Context
from pipeline.averaging.placement import Placement, place

ALGORITHMS = {"tree": tree, "gather": gather, "sharded": sharded, "hierarchical": hierarchical}
LOCAL = ("tree", "gather")  # the algorithms that run on one host without a placement
MODELLED = ("tree", "sharded", "hierarchical")  # auto's candidates across hosts (the cost
#             model's): gather would send every state over every link


class Plan(NamedTuple):
    """The algorithm of a run and where its replicas live."""
    algorithm: str
    placement: Placement | None  # None: one host, tree or gather (the graph's pins place them)
    shards: int
    description: str  # one line for the log


def names() -> tuple:
    """What ``average.algorithm`` accepts: auto and the registered algorithms."""
    return ("auto", *ALGORITHMS)


def get(name: str):
    """The module of algorithm ``name``; ValueError naming the field for any other name."""
    if name not in ALGORITHMS:
        raise ValueError(f"average.algorithm must be one of {names()}, got {name!r}")
    return ALGORITHMS[name]


def workers_by_host(client, resources: dict | None = None) -> dict[str, list[str]]:
    """``{host: [worker address, ...]}`` of the workers that offer ``resources`` (not those
    Dask is retiring: ``cluster.resources.staying``)."""
    from distributed.comm import get_address_host

    from pipeline.cluster.resources import staying
    out: dict[str, list[str]] = {}
    for address, info in staying(client.scheduler_info(n_workers=-1)["workers"]).items():
        have = info.get("resources") or {}
        if all(have.get(name, 0) >= amount for name, amount in (resources or {}).items()):
            out.setdefault(get_address_host(address), []).append(address)
    return out


def predict(name: str, placement: Placement, state_bytes: float, cfg) -> tuple[float, int]:
    """``pipeline.averaging.cost``'s ``(seconds, shards)`` for one all-reduce with algorithm ``name``
    on links of ``cfg.link_gbps`` and this machine's local costs; with ``cfg.shards`` 0 the
    fastest shard count."""
    link = cost.Link(bandwidth=cfg.link_gbps * 1e9 / 8)
    p, hosts, units = placement.n_replicas, placement.n_hosts, len(placement.units())
    if name == "tree":
        return cost.comm_time(state_bytes, p, link, cost.THIS_MACHINE, algorithm=name,
                                 fan_in=cfg.fan_in, hosts=hosts, broadcast="binomial"), units
    if cfg.shards:
        return cost.comm_time(state_bytes, p, link, cost.THIS_MACHINE, algorithm=name,
                                 fan_in=cfg.fan_in, hosts=hosts, shards=cfg.shards), cfg.shards
    shards, seconds = cost.best_shards(state_bytes, p, link, cost.THIS_MACHINE,
                                          algorithm=name, hosts=hosts, fan_in=cfg.fan_in)
    return seconds, shards


def choose(placement: Placement, state_bytes: float | None, cfg) -> tuple[str, int, str]:
    """``(algorithm, shards, why)`` for ``auto``: on one host ``gather`` where at most two
    workers hold replicas (the same bytes as the tree, both ways at once), else the tree; across
    hosts the fastest by the cost model (``sharded`` with a shard per host when the state size
    is not known yet)."""
    if placement.n_hosts == 1:
        if len(placement.hosts[0]) <= 2:
            return "gather", 1, "auto: one host, two workers"
        return "tree", 1, "auto: one host"
    if not state_bytes:
        return "sharded", cfg.shards or placement.n_hosts, f"auto: {placement.n_hosts} hosts"
    times = {name: predict(name, placement, state_bytes, cfg) for name in MODELLED}
    best = min(times, key=lambda n: times[n][0])
    others = ", ".join(f"{n} {t:.3g} s" for n, (t, _) in times.items() if n != best)
    return best, times[best][1], (f"auto: predicted {times[best][0]:.3g} s per average vs "
                                  f"{others} at {cfg.link_gbps:g} Gb/s")


def plan(client, cfg, replicas: int, state_bytes: float | None = None,
         resources: dict | None = None) -> Plan:
    """Resolve ``cfg.algorithm`` (an ``AverageConfig``) for the cluster ``client`` sees now and
    place ``replicas`` replicas on the workers offering ``resources``."""
    hosts = workers_by_host(client, resources)
    if not hosts:  # no worker yet: the tree, placed by Dask when they come
        return Plan("tree", None, 1, "tree (no workers to place replicas on yet)")
    placement = place(hosts, replicas)
    if cfg.algorithm == "auto":
        name, n_shards, why = choose(placement, state_bytes, cfg)
    else:
        name, n_shards, why = cfg.algorithm, cfg.shards or len(placement.units()), ""
    get(name)
    where = f"{replicas} replica(s) on {placement.n_hosts} host(s)"
    if name in LOCAL and placement.n_hosts == 1:
        placement = None  # one machine: the replicas' pins place the sums, no bytes cross hosts
    shards = f", {n_shards} shard(s)" if name not in LOCAL else ""
    return Plan(name, placement, n_shards, f"{name}, {where}{shards}{f' ({why})' if why else ''}")


def context(the_plan: Plan, client, token: str, coords: tuple, fan_in: int, replicas: int,
            name: str = "average") -> Context:
    """The Context an algorithm of ``the_plan`` builds one average in."""
    return Context(client, name, token, coords, fan_in, the_plan.placement, the_plan.shards,
                   replicas)


__all__ = ["ALGORITHMS", "Context", "Plan", "choose", "context", "get", "plan", "predict",
           "workers_by_host"]
