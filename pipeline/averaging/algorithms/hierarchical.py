"""``hierarchical`` (locality-aware, like ChainerMN's hierarchical communicator): each host first
adds up the largest subtrees of the fixed addition order whose replicas it holds (one float64
partial per subtree, computed on one of its workers from its neighbours' states over the
loopback), the hosts reduce-scatter those partials shard by shard, and each host assembles one
copy of the mean that its replicas read locally. Across hosts a host sends and receives its
partials' bytes once and one copy of the mean, however many replicas it holds.

Replicas are placed in contiguous blocks per host (``pipeline.averaging.placement``); with R replicas per
host and ``--fan-in`` R the local subtrees cover each host's replicas exactly. A lone replica
travels as its float32 state, so with one replica per host this is ``sharded``.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from pipeline.averaging.algorithms.base import (Context, gather_on, local_sum, node_name,
                                                reduce_scatter, scatter_allgather, take_all)
from pipeline.averaging.order import build, frontier, ident


def _frontier_values(ctx: Context, root, payloads: Sequence) -> dict:
    """``{ident: (future, worker)}``: each host's largest local subtrees, added up there."""
    pl, values = ctx.placement, {}
    for h in range(pl.n_hosts):
        for child in frontier(root, pl.replicas_on(h)):
            if isinstance(child, int):
                values[child] = (payloads[child], pl.replica_worker[child])
                continue
            worker = pl.replica_worker[child.first]
            states = {k: payloads[k] for k in range(child.first, child.stop)}
            task = partial(local_sum, root, child, prepare=ctx.prepare)
            values[ident(child)] = (ctx.submit(task, states, key=ctx.key("local",
                                                                           *node_name(child)),
                                               worker=worker), worker)
    return values


def _host_copies(ctx: Context, payloads: Sequence, workers: list) -> dict:
    root = build(len(payloads), ctx.fan_in)
    values = _frontier_values(ctx, root, payloads)
    if ident(root) in values:  # every replica on one host: the local sum is the mean
        return {w: values[ident(root)][0] for w in workers}
    return gather_on(ctx, reduce_scatter(ctx, root, take_all(ctx, values)), workers)


def reduce(ctx: Context, payloads: Sequence):
    """The mean as one future, assembled on replica 0's worker."""
    worker = ctx.placement.replica_worker[0]
    return _host_copies(ctx, payloads, [worker])[worker]


def broadcast(ctx: Context, value) -> list:
    """Per-replica futures of a value on replica 0's worker (scatter, then all-gather)."""
    return scatter_allgather(ctx, value, ctx.placement.replica_worker[0])


def allreduce(ctx: Context, payloads: Sequence) -> list:
    """Per-replica futures of the mean: one copy per host, read by its replicas."""
    pl = ctx.placement
    copies = _host_copies(ctx, payloads, [pl.host_worker(h) for h in range(pl.n_hosts)])
    return [copies[pl.host_worker(h)] for h in pl.replica_host]
