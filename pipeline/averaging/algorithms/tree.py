"""``tree``: the replicas' states added up a tree of ``average-`` tasks (fan-in ``fan_in``), the
mean broadcast back. On one host every replica reads the root's result (Dask fetches it where
it is read); with pinned replicas the nodes run on their first replica's worker there too, so the
root is next to replica 0 (unpinned, Dask puts it on replica 1's worker in about half the rounds,
and the mean moves once more, 67 MB for cifar10-2015 with Adam, to replica 0's outer step).
Across hosts the tree's nodes run on their first replica's worker and the mean travels host to
host by doubling (``base.binomial_broadcast``), one copy per host.

The busiest link carries ``(f-1)`` states per level plus ``ceil(log2 H)`` copies: fine for
small states, the bottleneck for large ones (``pipeline.averaging.cost``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from pipeline.averaging import exact
from pipeline.averaging.algorithms.base import Context, binomial_broadcast
from pipeline.averaging.reduction import tree_reduce


def _leaf(payload, prepare: Callable | None = None):
    """A replica's payload as the tree adds it: the state itself, weight 1. ``combine`` adds a
    raw state straight into its float64 sums, so no float64 copy of the inputs is made (a
    ``leaf`` copy was 2x the state's bytes written per replica: 0.09 s against 0.036 s for two
    67 MB cifar10-2015 Adam states; the same bits, float32 -> float64 being exact)."""
    return prepare(payload) if prepare is not None else payload


def reduce(ctx: Context, payloads: Sequence):
    """The mean as one future (the tree's root; on replica 0's worker when placed)."""
    pl = ctx.placement
    leaf = partial(_leaf, prepare=ctx.prepare) if ctx.prepare is not None else _leaf
    return tree_reduce(ctx.client, payloads, exact.combine, exact.finalize,
                       fan_in=ctx.fan_in, name=ctx.name, token=ctx.token,
                       coords=ctx.coords, leaf=leaf,
                       combine_finalize=exact.combine_finalize,
                       workers=pl.replica_worker if pl is not None else ctx.homes)


def broadcast(ctx: Context, value) -> list:
    """Per-replica futures of a value on replica 0's worker."""
    return binomial_broadcast(ctx, value)


def allreduce(ctx: Context, payloads: Sequence) -> list:
    """Per-replica futures of the mean."""
    mean = reduce(ctx, payloads)
    if ctx.placement is None:
        return [mean] * len(payloads)
    return broadcast(ctx, mean)
