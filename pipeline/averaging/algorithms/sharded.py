"""``sharded``: reduce-scatter, then all-gather. Each replica's state is cut into S shards by byte
ranges (``pipeline.averaging.slices``); shard s of every replica goes to one worker on host s mod H, which
adds them in the fixed order (``pipeline.averaging.order``) and divides; every replica's worker
then fetches the S averaged shards and puts them together. Every link carries about
``2 L (K-1)/K`` instead of the tree root's ``K L``, and no host does more adding than another.
"""
from __future__ import annotations

from collections.abc import Sequence

from pipeline.averaging.algorithms.base import (Context, gather_on, reduce_scatter,
                                                replica_inputs, scatter_allgather, take_all)
from pipeline.averaging.order import build


def _reduced(ctx: Context, payloads: Sequence) -> list:
    root = build(len(payloads), ctx.fan_in)
    return reduce_scatter(ctx, root, take_all(ctx, replica_inputs(ctx, payloads)))


def reduce(ctx: Context, payloads: Sequence):
    """The mean as one future, assembled on replica 0's worker."""
    worker = ctx.placement.replica_worker[0]
    return gather_on(ctx, _reduced(ctx, payloads), [worker])[worker]


def broadcast(ctx: Context, value) -> list:
    """Per-replica futures of a value on replica 0's worker (scatter, then all-gather)."""
    return scatter_allgather(ctx, value, ctx.placement.replica_worker[0])


def allreduce(ctx: Context, payloads: Sequence) -> list:
    """Per-replica futures of the mean: one assembled copy per worker holding replicas."""
    workers = ctx.placement.replica_worker
    copies = gather_on(ctx, _reduced(ctx, payloads), workers)
    return [copies[w] for w in workers]
