"""``gather``: every worker holding replicas fetches every replica's state and adds them itself
(an all-gather, then one local sum per worker), in the fixed order of
:mod:`pipeline.averaging.order`, so each copy of the mean is the tree's bits.

Made for one host with two workers (``auto`` takes it there): the tree sends replica 1's state
to replica 0's worker, adds, and sends the mean back, two copies one after the other between
rounds; here each worker fetches the other's state while the other fetches its own, and both
add at once. The same bytes cross (one state each way), the round's barrier loses one copy and a
scheduler hop, and each worker adds K states (the tree's additions, once per worker, in
parallel). With W workers each fetches K - (its own) states: past two, the tree moves fewer
bytes, and across hosts every state would cross every link.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from pipeline.averaging.algorithms.base import Context, binomial_broadcast, local_sum
from pipeline.averaging.order import build


def _workers(ctx: Context) -> list | None:
    """The worker of each replica: its placement's, or on one host the graph's pins; None
    where replicas are not placed (one sum, where Dask puts it)."""
    if ctx.placement is not None:
        return list(ctx.placement.replica_worker)
    return list(ctx.homes) if ctx.homes else None


def _sum_on(ctx: Context, payloads: Sequence, worker: str | None, index: int):
    """Future of the mean of every payload, added on ``worker``."""
    root = build(len(payloads), ctx.fan_in)
    task = partial(local_sum, root, root, prepare=ctx.prepare)  # the order rides with the task
    return ctx.submit(task, dict(enumerate(payloads)), key=ctx.key("local", index),
                      worker=worker)


def allreduce(ctx: Context, payloads: Sequence) -> list:
    """Per-replica futures of the mean: one copy added on each worker holding replicas."""
    workers = _workers(ctx)
    if workers is None:
        return [_sum_on(ctx, payloads, None, 0)] * len(payloads)
    copies = {w: _sum_on(ctx, payloads, w, i) for i, w in enumerate(dict.fromkeys(workers))}
    return [copies[w] for w in workers]


def reduce(ctx: Context, payloads: Sequence):
    """The mean as one future, added on replica 0's worker."""
    workers = _workers(ctx)
    return _sum_on(ctx, payloads, workers[0] if workers else None, 0)


def broadcast(ctx: Context, value) -> list:
    """Per-replica futures of a value on replica 0's worker: on one host every replica reads it
    there; across hosts one copy per host by doubling, as the tree."""
    return binomial_broadcast(ctx, value)
