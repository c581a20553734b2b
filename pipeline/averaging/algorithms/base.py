"""What the averaging algorithms share: the context they build in, pinned submits, the
reduce-scatter of shards, and the two broadcasts (binomial over hosts, scatter + all-gather).

Every task of an average is keyed ``("average-<token>", round, <step>, ...)``: the dashboard
shows them all as ``average``, the driver charges them to the round, and the step name in the
tuple (``take``, ``reduce``, ``gather``, ``local``, ``copy``...) says what each one does.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

from pipeline.averaging import slices
from pipeline.core import keys
from pipeline.averaging.exact import combine, combine_finalize
from pipeline.averaging.placement import Placement
from pipeline.averaging.order import Node, evaluate, ident

if TYPE_CHECKING:
    from distributed import Client


class Context(NamedTuple):
    """Where and under which keys one average is built."""
    client: Client
    name: str  # the stage in the keys: "average"
    token: str  # the run token (8 hex digits)
    coords: tuple  # (round,)
    fan_in: int  # of the fixed addition order (reduce_order.build)
    placement: Placement | None  # None: one host and the tree; Dask places its nodes
    shards: int  # S of the sharded algorithms
    replicas: int  # K
    prepare: Callable | None = None  # payload -> the state dict to average, run where the
    #                                  payload is consumed (ipm: params + optimizer state)
    homes: tuple | None = None  # one host, replicas pinned: each replica's worker (the tree's
    #                             nodes then run on their first input's, the root on replica 0's)

    def key(self, *parts) -> tuple:
        return keys.make(self.name, self.token, *self.coords, *parts)

    def submit(self, fn, *args, key, worker: str | None = None):
        """``client.submit`` with a loose pin: on ``worker`` while it lives, else anywhere (a
        lost worker costs placement, never the result)."""
        pin = dict(workers=[worker], allow_other_workers=True) if worker else {}
        return self.client.submit(fn, *args, key=key, pure=False, **pin)


# ---- functions that run in tasks -------------------------------------------------------------

def copy(value, *after):
    """The value itself, on this task's worker (``after``: tasks that must finish first)."""
    return value


def done(value) -> bool:
    """A few bytes saying a copy has landed (lets the next copy wait without fetching it)."""
    return True


def local_sum(root: Node, node: Node, states: Mapping, prepare: Callable | None = None):
    """A subtree of the addition order over replicas held on one host: float64 partial sums
    (or the final mean when the subtree is the whole tree)."""
    if prepare is not None:
        states = {k: prepare(v) for k, v in states.items()}
    return evaluate(root, dict(states), combine, combine_finalize, top=node)


def take_payload(prepare: Callable, value, n_shards: int, index: int) -> slices.Piece:
    """``shards.take`` of ``prepare(value)``: a replica's payload cut where it lives."""
    return slices.take(prepare(value), n_shards, index)


def reduce_shard(root: Node, pieces: Mapping) -> slices.Piece:
    """One shard's mean over all replicas: ``shards.reduce_pieces`` (a task function)."""
    return slices.reduce_pieces(pieces, root)


def assemble(*pieces: slices.Piece) -> dict:
    """The whole state from its averaged shards (``shards.assemble``)."""
    return slices.assemble(list(pieces))


# ---- graph pieces ----------------------------------------------------------------------------

def shard_owners(ctx: Context) -> list[str]:
    """The worker reducing each shard: shard s on unit (host) s mod units, spread over that
    host's workers."""
    units = ctx.placement.units()
    return [units[s % len(units)][(s // len(units)) % len(units[s % len(units)])]
            for s in range(ctx.shards)]


def take_all(ctx: Context, values: Mapping) -> dict:
    """``{ident: [S futures]}``: every value's shards, cut where it lives.

    ``values``: ``{ident: (future, worker)}``; an int ident is a replica's payload (passed
    through ``ctx.prepare``), a tuple one a partial sum. A piece is a view of the value, so a
    take task copies nothing and Dask ships exactly the piece's bytes."""
    out = {}
    for name, (future, worker) in values.items():
        where = name if isinstance(name, tuple) else (name,)
        fn = slices.take
        if ctx.prepare is not None and not isinstance(name, tuple):
            fn = partial(take_payload, ctx.prepare)
        out[name] = [ctx.submit(fn, future, ctx.shards, s, key=ctx.key("take", *where, s),
                                worker=worker) for s in range(ctx.shards)]
    return out


def reduce_scatter(ctx: Context, root: Node, pieces: Mapping) -> list:
    """One ``reduce`` task per shard, on its owner, adding the pieces in the fixed order."""
    owners = shard_owners(ctx)
    task = partial(reduce_shard, root)  # the plan rides with the function, not as a dask arg
    return [ctx.submit(task, {name: futs[s] for name, futs in pieces.items()},
                       key=ctx.key("reduce", s), worker=owners[s]) for s in range(ctx.shards)]


def gather_on(ctx: Context, reduced: Sequence, workers: Sequence[str], step: str = "gather"
              ) -> dict:
    """``{worker: future}``: the assembled state on each distinct worker given."""
    return {w: ctx.submit(assemble, *reduced, key=ctx.key(step, i), worker=w)
            for i, w in enumerate(dict.fromkeys(workers))}


def replica_inputs(ctx: Context, payloads: Sequence) -> dict:
    """``{replica: (future, worker)}``."""
    return {k: (f, ctx.placement.replica_worker[k]) for k, f in enumerate(payloads)}


def binomial_broadcast(ctx: Context, value) -> list:
    """Per-replica futures of ``value`` (held on host 0), copied host to host by doubling:
    in step j every host holding a copy sends one to a host that has none (host h gets its
    copy from h - 2^floor(log2 h)); a sender's next copy waits for its previous one to land
    (a ``done`` marker of a few bytes), so each link carries one copy at a time. Replicas read
    their host's copy, over the loopback."""
    pl = ctx.placement
    if pl is None or pl.n_hosts == 1:
        return [value] * ctx.replicas
    copies, last_sent = {0: value}, {}
    for h in range(1, pl.n_hosts):
        parent = h - (1 << (h.bit_length() - 1))
        after = [last_sent[parent]] if parent in last_sent else []
        worker = pl.host_worker(h)
        copies[h] = ctx.submit(copy, copies[parent], *after, key=ctx.key("copy", h),
                               worker=worker)
        last_sent[parent] = ctx.submit(done, copies[h], key=ctx.key("sent", h), worker=worker)
    return [copies[h] for h in pl.replica_host]


def scatter_allgather(ctx: Context, value, source: str) -> list:
    """Per-replica futures of ``value`` (held on worker ``source``): its S shards go one to
    each shard owner, then every host assembles them (``2 L (H-1)/H`` per link, as the
    all-reduce's second half)."""
    pl = ctx.placement
    if pl is None or pl.n_hosts == 1:
        return [value] * ctx.replicas
    owners = shard_owners(ctx)
    held = [ctx.submit(copy, ctx.submit(slices.take, value, ctx.shards, s,
                                        key=ctx.key("bcast-take", s), worker=source),
                       key=ctx.key("bcast-hold", s), worker=owners[s])
            for s in range(ctx.shards)]
    hosts = gather_on(ctx, held, [pl.host_worker(h) for h in range(pl.n_hosts)], "bcast-gather")
    return [hosts[pl.host_worker(h)] for h in pl.replica_host]


def node_name(child) -> tuple:
    """A frontier value's coordinates in task keys: (replica,) or (level, index)."""
    name = ident(child)
    return name if isinstance(name, tuple) else (name,)
