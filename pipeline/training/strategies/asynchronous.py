"""``async``: asynchronous updates through a parameter server built as a Dask graph (the
"asynchronous update" of Dean et al. 2012's Downpour SGD; docs/strategies.md).

No barrier: each replica pulls the newest parameters, takes H local steps (``push="delta"``;
``average.mix_every``) or computes one gradient (``push="gradient"``), and pushes its update; an
``apply-`` task applies updates one at a time to the newest parameters, and a replica restarts
from them as soon as its own update is applied. Staleness, the number of updates applied between
a replica's pull and its push, is recorded per update; updates can be scaled by
``1 / (1 + staleness)`` (the staleness-aware learning rate of Zhang et al., IJCAI 2016, "Staleness-
aware Async-SGD for Distributed Deep Learning", with the +1 so a fresh update counts whole). With
K replicas at equal speed the steady staleness is K - 1, so each update enters at weight 1/K: the
rate at which ``ipm`` takes in its K deltas.

The order of application is ``arrival`` (whoever finishes first; the driver reacts to completed
``train-`` tasks), ``fixed`` (slot order: a deterministic order with the equal-speed staleness
pattern, so results are byte-identical on any number of workers) or a replay of the order an
arrival run logged to ``OUT/updates.jsonl``. The order decides everything else (which data a
replica trains on next, what it pulls), so a replay reproduces a run byte for byte.

Work is cut into the slots of ipm's plan: round r has K slots (its K shards of H steps); slot
``(r, i)`` goes to the next replica that needs work, and round r is complete once K more updates
are applied. This is not Hogwild! (Niu et al. 2011): its lock-free, sparse in-place writes suit
sparse models; dense CNN updates are applied whole, one at a time, by one task.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from pipeline.training import tasks
from pipeline.averaging.exact import is_float
from pipeline.core.state import HostState
from pipeline.core.errors import UsageError
from pipeline.core.files import MIB, read_text
from pipeline.training.strategies.base import Strategy, Submitted

if TYPE_CHECKING:
    from distributed import Future

    from pipeline.training.graph import Trained

UPDATES = "updates.jsonl"  # the order an arrival run applied its updates, one line per update


# ---- task bodies ---------------------------------------------------------------------------
def apply(server: dict, pulled: dict, pushed: dict, scale: float) -> dict:
    """The newest parameters plus a replica's scaled delta: ``server + scale * (pushed - pulled)``,
    in float64, cast back per entry; integer entries (BatchNorm's counter) add the delta whole.

    >>> s, p, q = {"W": np.float32([1.0])}, {"W": np.float32([0.0])}, {"W": np.float32([0.5])}
    >>> apply(s, p, q, 0.5)["W"]
    array([1.25], dtype=float32)
    """
    out = {}
    for key, value in server.items():
        value = np.asarray(value)
        if is_float(value):
            delta = np.subtract(pushed[key], pulled[key], dtype=np.float64)
            out[key] = (value + scale * delta).astype(value.dtype)
        else:
            out[key] = value + (np.asarray(pushed[key]) - np.asarray(pulled[key]))
    return out


def apply_gradient(server: dict, opt: dict | None, gradient: dict, scale: float,
                   spec: tasks.StepSpec) -> tuple:
    """One optimizer step of the server with a replica's gradient times ``scale``; returns
    ``(params, optimizer_state)``."""
    scaled = {k: (v * np.asarray(scale, v.dtype)) if is_float(v) and k in server else v
              for k, v in gradient.items()}
    return tasks.update(server, opt, scaled, spec)


# ---- the order of application, as a pure state ----------------------------------------------
class InFlight(NamedTuple):
    slot: int  # global slot index t = round * K + i
    pulled: int  # version it started from (updates applied before its pull)


def allowed(n: int, replica: int, inflight: dict, max_staleness: int | None) -> bool:
    """Whether applying ``replica``'s update as the n-th (0-based) keeps every other in-flight
    replica within ``max_staleness`` (they would be applied at n + 1 or later).

    >>> f = {0: InFlight(3, 3), 1: InFlight(1, 1)}
    >>> allowed(3, 0, f, 2), allowed(3, 0, f, None), allowed(3, 1, f, 2)
    (False, True, True)
    """
    if max_staleness is None:
        return True
    return all(n + 1 - f.pulled <= max_staleness for k, f in inflight.items() if k != replica)


def fixed_order(replicas: int, updates: int) -> list[int]:
    """The fixed order: slot order, i.e. replicas round-robin (steady staleness K - 1).

    >>> fixed_order(3, 7)
    [0, 1, 2, 0, 1, 2, 0]
    """
    return [n % replicas for n in range(updates)]


UPDATE_BYTES = 1024  # an update record is ~150 bytes; a log may hold 1 KiB per update, plus 1 MiB


def read_order(path: str, replicas: int, updates: int) -> list[int]:
    """The replica of each position from an ``updates.jsonl``; UsageError naming what is wrong.

    Read as every user file is (``files.read_text``: a regular file, never a FIFO or a device,
    at most 1 KiB per update), split on newlines only (a record holds no other line break), each
    record's position and replica plain integers, each position once, and the order one an
    arrival run can have applied (:func:`check_replayable`).
    """
    limit = MIB + UPDATE_BYTES * updates
    try:
        text = read_text(path, limit, f"an update log of {updates} updates", UsageError)
    except UsageError as exc:
        raise UsageError(f"cannot read --replay-updates {exc}") from None
    order: dict[int, int] = {}
    for number, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        position, replica = _update_record(raw, f"--replay-updates {path}: line {number}")
        if position is None:
            continue  # an event line (a replay after lost work)
        if not 0 <= replica < replicas:
            raise UsageError(f"--replay-updates {path}: line {number} names replica {replica}, "
                             f"but the run has {replicas}")
        if position in order:
            raise UsageError(f"--replay-updates {path}: line {number} names position {position} "
                             "again (each position is applied once)")
        order[position] = replica
    if len(order) != updates or any(not 0 <= n < updates for n in order):
        raise UsageError(f"--replay-updates {path}: holds {len(order)} updates, the run applies "
                         f"{updates} (positions 0..{updates - 1} each once)")
    order_list = [order[n] for n in range(updates)]
    check_replayable(order_list, replicas, f"--replay-updates {path}")
    return order_list


def _update_record(raw: str, where: str) -> tuple[int | None, int]:
    """``(position, replica)`` of one log line (``(None, 0)`` for an event line); UsageError
    for anything else: not JSON, nested too deep, ``Infinity``, a number that is not an int."""
    try:
        line = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        line = None
    if isinstance(line, dict) and "position" not in line:
        return None, 0
    if not isinstance(line, dict) or not all(type(line.get(f)) is int
                                             for f in ("position", "replica")):
        raise UsageError(f"{where} is not an update record (an object with integer position "
                         "and replica)")
    if line["position"] < 0:
        raise UsageError(f"{where} names position {line['position']}")
    return line["position"], line["replica"]


def _no_constant(name: str):
    raise ValueError(name)  # Infinity, -Infinity and NaN are not JSON numbers


def check_replayable(order: list[int], replicas: int, where: str) -> None:
    """UsageError unless each position names a replica with an update in flight then: every
    replica starts with one slot and takes the next free slot when its update is applied, until
    the slots run out (what ``AsyncStrategy`` does). An order naming a replica that has
    nothing left to apply would otherwise fail mid-run.

    >>> check_replayable([0, 1, 0, 1], 2, "x")
    >>> check_replayable([0, 0, 0, 0], 2, "x")
    Traceback (most recent call last):
    pipeline.core.errors.UsageError: x: position 3 names replica 0, which has no update left to apply then (an arrival run never logs that)
    """
    inflight, next_slot = set(range(min(replicas, len(order)))), min(replicas, len(order))
    for n, k in enumerate(order):
        if k not in inflight:
            raise UsageError(f"{where}: position {n} names replica {k}, which has no update left "
                             "to apply then (an arrival run never logs that)")
        if next_slot < len(order):
            next_slot += 1
        else:
            inflight.discard(k)


class Flight(NamedTuple):
    """A replica's update in flight: where it sits in the order, the state it started from, and
    the futures of its train- task."""
    at: InFlight
    pulled: Future  # the parameters it pulled
    opt: Future | None  # the optimizer state it started from (None: fresh)
    out: Trained


class AsyncLive(NamedTuple):
    """The state after a round, as futures: the server's params (and optimizer state for
    gradient pushes) and each replica's update in flight, with the order's bookkeeping."""
    server: Future  # the newest parameters
    server_opt: Future | None  # their optimizer state (gradient pushes), else None
    applied: int  # updates applied so far
    next_slot: int  # first slot not handed out yet
    inflight: dict  # replica -> Flight
    arrived: tuple = ()  # replicas whose update is done but not applied, in arrival order
    stale: frozenset = frozenset()  # replicas in flight at the last reroot (see ``reroot``)


# ---- the strategy --------------------------------------------------------------------------
class Async(Strategy):
    name = "async"
    mix = "every"
    stages = ("load", "augment", "train", "apply", "evaluate")
    files = (UPDATES,)

    @classmethod
    def check(cls, config) -> None:
        a, k = config.asynchronous, config.train.replicas
        if a.max_staleness is not None and a.max_staleness < k - 1:
            raise UsageError(f"asynchronous.max_staleness must be >= replicas - 1 = {k - 1} "
                             f"(the first K updates are K - 1 stale), got {a.max_staleness}")
        if a.replay_updates and a.order != "arrival":
            raise UsageError("asynchronous.replay_updates replays an arrival run: leave "
                             f"asynchronous.order at arrival, got {a.order!r}")

    @classmethod
    def recipe(cls, config) -> dict:
        """For K > 1 the replicas' lr scales as ipm's does (docs/strategies.md): with updates
        entering at 1 / (1 + staleness), about 1/K at equal speeds, unscaled replicas would move
        the server K times slower than single moves its model."""
        from pipeline.training.strategies.ipm import IPM
        rules = IPM.recipe(config)
        return {k: v for k, v in rules.items() if k.startswith("train.")}

    @property
    def acfg(self):
        return self.ctx.config.asynchronous

    @classmethod
    def period_of(cls, config, per_epoch):
        return 1 if config.asynchronous.push == "gradient" else super().period_of(config,
                                                                                  per_epoch)

    def initial_state(self, params):
        return HostState(-1, [params] * (self.K + 1), [None] * (self.K + 1), None)

    # ---- attempt start -------------------------------------------------------------------
    def restart(self, anchor, shard, out, replay: bool) -> None:
        """The attempt's fixed facts: its shards, the plan's slots, the order of application
        (fixed, replayed, or None for arrival), and updates.jsonl cut back to the anchor."""
        self.shard = shard
        self.rounds_ = list(self.ctx.plan) or self.rounds()
        self.total = len(self.rounds_) * self.K
        self.out = out
        self.order = None
        if self.acfg.replay_updates:
            self.order = read_order(self.acfg.replay_updates, self.K, self.total)
        elif self.acfg.order == "fixed":
            self.order = fixed_order(self.K, self.total)
        if out:  # the log holds what made the state: drop updates past the anchor
            kept = (anchor.round + 1) * self.K
            out.truncate(UPDATES, lambda x: "position" not in x or x["position"] < kept,
                         records=self.total + len(self.rounds_))  # updates, replay events
            if replay:
                out.append(UPDATES, [dict(event="replay", from_round=anchor.round + 1,
                                          from_position=kept, order=self.acfg.order)])

    def scatter(self, state: HostState) -> AsyncLive:
        g = self.graph
        server = g.scatter(state.params[0])
        server_opt = g.scatter(state.opts[0]) if state.opts[0] is not None else None
        if state.round < 0:
            live = AsyncLive(server, server_opt, 0, 0, {})
            for k in range(self.K):
                live = self._start(live, k, server, None, pulled=0)
            return live
        sched = state.outer
        live = AsyncLive(server, server_opt, (state.round + 1) * self.K,
                         int(sched["next_slot"][0]), {})
        for k in range(self.K):
            slot = int(sched["slot"][k])
            if slot < 0:
                continue
            opt = state.opts[1 + k]
            live = self._start(live, k, g.scatter(state.params[1 + k]),
                               g.scatter(opt) if opt is not None else None,
                               pulled=int(sched["pulled"][k]), slot=slot)
        return live

    def reroot(self, state: HostState, live: AsyncLive) -> AsyncLive:
        """Go on from fresh roots without redoing in-flight work: the server (and its optimizer
        state) and each in-flight replica's pull become the gathered ``state`` scattered back.
        A replica in flight still computes from the old lineage, so its outputs are gathered and
        scattered when its update is applied (``_apply``). After that no task hangs off the
        rounds before the anchor, and the workers forget them (an unbroken apply- chain kept
        every update's records on its worker)."""
        ks = sorted(live.inflight)
        roots = self.graph.scatter_many([state.params[0], state.opts[0],
                                         *(state.params[1 + k] for k in ks),
                                         *(state.opts[1 + k] for k in ks)])  # one round trip
        inflight = dict(live.inflight)
        for k, pulled, opt in zip(ks, roots[2:2 + len(ks)], roots[2 + len(ks):]):
            inflight[k] = inflight[k]._replace(pulled=pulled, opt=opt)
        return live._replace(server=roots[0], server_opt=roots[1], inflight=inflight,
                             stale=frozenset(ks))

    def _fresh(self, k: int, params, opt) -> list:
        """Replica k's train outputs as roots with no lineage (gathered, scattered back)."""
        return self.graph.scatter_many(self.graph.gather([params, opt]), replica=k)

    def gather(self, round_index: int, live: AsyncLive) -> HostState:
        ks = sorted(live.inflight)
        server, server_opt, pulled, opts = self.graph.gather(
            [live.server, live.server_opt, [live.inflight[k].pulled for k in ks],
             [live.inflight[k].opt for k in ks]])
        params, replica_opts = [server] * self.K, [None] * self.K
        slot, versions = np.full(self.K, -1, np.int64), np.zeros(self.K, np.int64)
        for j, k in enumerate(ks):
            params[k], replica_opts[k] = pulled[j], opts[j]
            slot[k], versions[k] = live.inflight[k].at.slot, live.inflight[k].at.pulled
        sched = dict(slot=slot, pulled=versions, next_slot=np.array([live.next_slot], np.int64))
        return HostState(round_index, [server, *params], [server_opt, *replica_opts], sched)

    # ---- a round -------------------------------------------------------------------------
    def _start(self, live: AsyncLive, k: int, params, opt, *, pulled: int,
               slot: int | None = None) -> AsyncLive:
        """Replica k takes its next slot (or ``slot``) from ``params`` pulled at ``pulled``."""
        next_slot = live.next_slot
        if slot is None:
            if next_slot >= self.total:
                return live  # no work left: the replica is done
            slot, next_slot = next_slot, next_slot + 1
        r, i = divmod(slot, self.K)
        rnd = self.rounds_[r]
        mode = "gradient" if self.acfg.push == "gradient" else "steps"
        out = self.graph.submit_train(rnd, i, params, opt if mode == "steps" else None,
                                      self.shard(r, i), self.ctx.spec(rnd, i, mode), pin=k)
        flight = Flight(InFlight(slot, pulled), params, opt, out)
        return live._replace(next_slot=next_slot, inflight={**live.inflight, k: flight})

    def _next(self, live: AsyncLive) -> tuple[int, AsyncLive]:
        """The replica whose update is applied next, and the state without it among the
        arrived."""
        n = live.applied
        if self.order is not None:
            return self.order[n], live
        arrived = list(live.arrived)
        while True:
            for k in arrived:
                if allowed(n, k, {j: f.at for j, f in live.inflight.items()},
                           self.acfg.max_staleness):
                    arrived.remove(k)
                    return k, live._replace(arrived=tuple(arrived))
            waiting = [k for k in sorted(live.inflight) if k not in arrived]
            if not waiting:  # cannot happen with max_staleness >= K - 1 (see check)
                raise RuntimeError(f"no update can be applied at position {n}")
            results = [live.inflight[k].out.result for k in waiting]
            done_ids = {id(f) for f in self.graph.first_done(results)}
            arrived += [k for k in waiting if id(live.inflight[k].out.result) in done_ids]

    def _apply(self, live: AsyncLive, k: int) -> tuple[AsyncLive, object, dict]:
        """Apply replica k's update to the server as the next one; k starts its next slot from
        the result. Returns the new state, the update's metrics future and its log record."""
        inflight = dict(live.inflight)
        flight = inflight.pop(k)
        params, opt, metrics, _ = flight.out
        if k in live.stale:
            params, opt = self._fresh(k, params, opt)
        n = live.applied
        r, i = divmod(n, self.K)
        staleness = n - flight.at.pulled
        scale = 1.0 / (1 + staleness) if self.acfg.staleness_scaling == "inverse" else 1.0
        server, server_opt = live.server, live.server_opt
        if self.acfg.push == "gradient":
            server, server_opt = self.graph.submit(
                apply_gradient, server, server_opt, params, scale,
                self.ctx.spec(self.rounds_[r], i), stage="apply", coords=(r, i),
                fields=("params", "opt"), train=True)
        else:
            server = self.graph.submit(apply, server, flight.pulled, params, scale,
                                       stage="apply", coords=(r, i))
        record = dict(position=n, round=r, replica=k, slot=list(divmod(flight.at.slot, self.K)),
                      pulled=flight.at.pulled, staleness=staleness, scale=scale)
        live = live._replace(server=server, server_opt=server_opt, applied=n + 1,
                             inflight=inflight, stale=live.stale - {k})
        live = self._start(live, k, server, opt if self.acfg.push == "delta" else None,
                           pulled=n + 1)
        return live, metrics, record

    def submit_round(self, rnd, live, shard):
        """Apply updates until round ``rnd``'s K are in; its records are their log lines."""
        target = (rnd.index + 1) * self.K
        metrics, records = [], []
        while live.applied < target:
            k, live = self._next(live)
            live, update_metrics, record = self._apply(live, k)
            metrics.append(update_metrics)
            records.append(record)
        return Submitted(live, metrics, tuple(records))

    def model(self, rnd, live):
        return live.server

    @classmethod
    def average_payload(cls, config, param_bytes):
        return 0  # no average: updates go one by one to the apply- chain

    def bytes_averaged(self, rnd):
        return self.graph.payload_bytes * self.K  # every update ships one replica's params

    def round_fields(self, rnd, metrics, records=()):
        stale = [x["staleness"] for x in records]
        by_replica = [sum(1 for x in records if x["replica"] == k) for k in range(self.K)]
        return dict(staleness_mean=round(float(np.mean(stale)), 4) if stale else 0.0,
                    staleness_max=int(max(stale)) if stale else 0, updates_by_replica=by_replica)

    def collected(self, rnd, records=()) -> None:
        if self.out:
            self.out.append(UPDATES, list(records))
