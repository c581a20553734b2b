"""``async``: asynchronous updates through a parameter server built as a Dask graph (seed 000's
fourth method, "Asynchronous Update").

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
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pipeline.training import tasks
from pipeline.averaging.exact import is_float
from pipeline.outputs.checkpoint import HostState
from pipeline.core.errors import UsageError
from pipeline.training.strategies.base import Strategy, Submitted

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


def read_order(path: str, replicas: int, updates: int) -> list[int]:
    """The replica of each position from an ``updates.jsonl``; UsageError naming what is wrong."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read --replay-updates {path}: {exc.strerror or exc}") from None
    order: dict[int, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        try:
            line = json.loads(raw)
            if "position" not in line:
                continue  # an event line (a replay after lost work)
            position, replica = int(line["position"]), int(line["replica"])
        except (ValueError, TypeError, KeyError, AttributeError):
            raise UsageError(f"--replay-updates {path}: line {number} is not an update "
                             "record") from None
        if not 0 <= replica < replicas:
            raise UsageError(f"--replay-updates {path}: line {number} names replica {replica}, "
                             f"but the run has {replicas}")
        order[position] = replica
    if sorted(order) != list(range(updates)):
        raise UsageError(f"--replay-updates {path}: holds {len(order)} updates, the run applies "
                         f"{updates} (positions 0..{updates - 1} each once)")
    return [order[n] for n in range(updates)]


class AsyncLive(NamedTuple):
    """Futures of the state after a round: the server's params (and optimizer state for
    gradient pushes), and per replica its in-flight slot, its pull, and its optimizer state."""
    server: object
    server_opt: object
    applied: int  # updates applied so far
    next_slot: int  # first slot not handed out yet
    inflight: dict  # replica -> (InFlight, pulled params future, optimizer state future)


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
        self.shard = shard
        self.rounds_ = list(self.ctx.plan) or self.rounds()
        self.total = len(self.rounds_) * self.K
        self.out = out
        self.order = None
        if self.acfg.replay_updates:
            self.order = read_order(self.acfg.replay_updates, self.K, self.total)
        elif self.acfg.order == "fixed":
            self.order = fixed_order(self.K, self.total)
        self.log_lines: dict[int, list] = {}
        self.metrics_by_round: dict[int, list] = {}
        self.arrived: list[int] = []
        if out:  # the log holds what made the state: drop updates past the anchor
            kept = (anchor.round + 1) * self.K
            out.truncate(UPDATES, lambda x: "position" not in x or x["position"] < kept)
            if replay:
                out.append(UPDATES, [dict(event="replay", from_round=anchor.round + 1,
                                          from_position=kept, order=self.acfg.order)])

    def scatter(self, state: HostState) -> AsyncLive:
        g = self.graph
        self.server = g.scatter(state.params[0])
        self.server_opt = g.scatter(state.opts[0]) if state.opts[0] is not None else None
        self.inflight: dict[int, tuple] = {}
        self.stale_roots: set[int] = set()  # in flight at the last reroot: see ``reroot``
        if state.round < 0:
            self.applied, self.next_slot = 0, 0
            for k in range(self.K):
                self._start(k, self.server, None, pulled=0)
        else:
            sched = state.outer
            self.applied = (state.round + 1) * self.K
            self.next_slot = int(sched["next_slot"][0])
            for k in range(self.K):
                slot = int(sched["slot"][k])
                if slot < 0:
                    continue
                opt = state.opts[1 + k]
                self._start(k, g.scatter(state.params[1 + k]),
                            g.scatter(opt) if opt is not None else None,
                            pulled=int(sched["pulled"][k]), slot=slot)
        return self._snapshot()

    def reroot(self, state: HostState, live: AsyncLive) -> AsyncLive:
        """Go on from fresh roots without redoing in-flight work: the server (and its optimizer
        state) and each in-flight replica's pull become the gathered ``state`` scattered back.
        A replica in flight still computes from the old lineage, so its outputs are gathered and
        scattered when its update is applied (``_apply``). After that no task hangs off the
        rounds before the anchor, and the workers forget them (an unbroken apply- chain kept
        every update's records on its worker)."""
        ks = sorted(self.inflight)
        roots = self.graph.scatter_many([state.params[0], state.opts[0],
                                         *(state.params[1 + k] for k in ks),
                                         *(state.opts[1 + k] for k in ks)])  # one round trip
        self.server, self.server_opt = roots[:2]
        for k, pulled, opt in zip(ks, roots[2:2 + len(ks)], roots[2 + len(ks):]):
            flight, _, _, out = self.inflight[k]
            self.inflight[k] = (flight, pulled, opt, out)
        self.stale_roots = set(ks)
        return self._snapshot()

    def _fresh(self, k: int, params, opt) -> list:
        """Replica k's train outputs as roots with no lineage (gathered, scattered back)."""
        return self.graph.scatter_many(self.graph.gather([params, opt]), replica=k)

    def _snapshot(self) -> AsyncLive:
        inflight = {k: (f[0], f[1], f[2]) for k, f in self.inflight.items()}
        return AsyncLive(self.server, self.server_opt, self.applied, self.next_slot, inflight)

    def gather(self, round_index: int, live: AsyncLive) -> HostState:
        ks = sorted(live.inflight)
        server, server_opt, pulled, opts = self.graph.gather(
            [live.server, live.server_opt, [live.inflight[k][1] for k in ks],
             [live.inflight[k][2] for k in ks]])
        params, replica_opts = [server] * self.K, [None] * self.K
        slot, versions = np.full(self.K, -1, np.int64), np.zeros(self.K, np.int64)
        for j, k in enumerate(ks):
            params[k], replica_opts[k] = pulled[j], opts[j]
            slot[k], versions[k] = live.inflight[k][0].slot, live.inflight[k][0].pulled
        sched = dict(slot=slot, pulled=versions, next_slot=np.array([live.next_slot], np.int64))
        return HostState(round_index, [server, *params], [server_opt, *replica_opts], sched)

    # ---- a round -------------------------------------------------------------------------
    def _start(self, k: int, params, opt, *, pulled: int, slot: int | None = None) -> None:
        """Replica k takes its next slot (or ``slot``) from ``params`` pulled at ``pulled``."""
        if slot is None:
            if self.next_slot >= self.total:
                return  # no work left: the replica is done
            slot, self.next_slot = self.next_slot, self.next_slot + 1
        r, i = divmod(slot, self.K)
        rnd = self.rounds_[r]
        mode = "gradient" if self.acfg.push == "gradient" else "steps"
        out = self.graph.submit_train(rnd, i, params, opt if mode == "steps" else None,
                                      self.shard(r, i), self.ctx.spec(rnd, i, mode), pin=k)
        self.inflight[k] = (InFlight(slot, pulled), params, opt, out)

    def _next(self) -> int:
        """The replica whose update is applied next."""
        n = self.applied
        if self.order is not None:
            return self.order[n]
        while True:
            for k in self.arrived:
                if allowed(n, k, {j: f[0] for j, f in self.inflight.items()},
                           self.acfg.max_staleness):
                    self.arrived.remove(k)
                    return k
            waiting = [k for k in sorted(self.inflight) if k not in self.arrived]
            if not waiting:  # cannot happen with max_staleness >= K - 1 (see check)
                raise RuntimeError(f"no update can be applied at position {n}")
            done = self.graph.first_done([self.inflight[k][3][3] for k in waiting])
            done_ids = {id(f) for f in done}
            self.arrived += [k for k in waiting if id(self.inflight[k][3][3]) in done_ids]

    def _apply(self, k: int) -> None:
        flight, pulled_params, _, (params, opt, metrics, _) = self.inflight.pop(k)
        if k in self.stale_roots:
            self.stale_roots.discard(k)
            params, opt = self._fresh(k, params, opt)
        n = self.applied
        r, i = divmod(n, self.K)
        staleness = n - flight.pulled
        scale = 1.0 / (1 + staleness) if self.acfg.staleness_scaling == "inverse" else 1.0
        if self.acfg.push == "gradient":
            self.server, self.server_opt = self.graph.submit(
                apply_gradient, self.server, self.server_opt, params, scale,
                self.ctx.spec(self.rounds_[r], i), stage="apply", coords=(r, i),
                fields=("params", "opt"), train=True)
        else:
            self.server = self.graph.submit(apply, self.server, pulled_params, params, scale,
                                            stage="apply", coords=(r, i))
        self.applied += 1
        self.metrics_by_round.setdefault(r, []).append(metrics)
        self.log_lines.setdefault(r, []).append(dict(
            position=n, round=r, replica=k, slot=list(divmod(flight.slot, self.K)),
            pulled=flight.pulled, staleness=staleness, scale=scale))
        self._start(k, self.server, opt if self.acfg.push == "delta" else None, pulled=n + 1)

    def submit_round(self, rnd, live, shard):
        target = (rnd.index + 1) * self.K
        while self.applied < target:
            self._apply(self._next())
        return Submitted(self._snapshot(), self.metrics_by_round.pop(rnd.index))

    def model(self, rnd, live):
        return live.server

    @classmethod
    def average_payload(cls, config, param_bytes):
        return 0  # no average: updates go one by one to the apply- chain

    def bytes_averaged(self, rnd):
        return self.graph.payload_bytes * self.K  # every update ships one replica's params

    def round_fields(self, rnd, metrics):
        stale = [x["staleness"] for x in self.log_lines.get(rnd.index, [])]
        by_replica = [sum(1 for x in self.log_lines.get(rnd.index, []) if x["replica"] == k)
                      for k in range(self.K)]
        return dict(staleness_mean=round(float(np.mean(stale)), 4) if stale else 0.0,
                    staleness_max=int(max(stale)) if stale else 0, updates_by_replica=by_replica)

    def collected(self, rnd) -> None:
        lines = self.log_lines.pop(rnd.index, [])
        if self.out:
            self.out.append(UPDATES, lines)
