"""One attempt from an anchor (the start, a resume, the last checkpoint): every future it holds in
one value, so a failure can cancel it all, and the strategy that submits its rounds.

Rounds are submitted one ahead of the one being collected, except at an anchor: its state is
gathered before the next round goes out, so that round starts from a root with no lineage.
Augmentation runs ``augment.prefetch`` rounds ahead of training.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, NamedTuple

from pipeline.core.errors import DivergenceError
from pipeline.outputs import checkpoint
from pipeline.core.state import HostState

if TYPE_CHECKING:
    from pipeline.core.schedule import Round
    from pipeline.training.graph import RoundGraph
    from pipeline.training.strategies.base import Strategy


class Pending(NamedTuple):
    """A round submitted but not collected."""
    rnd: Round
    live: object  # the strategy's state after this round (futures)
    metrics: list  # futures of the updates' metric dicts
    evals: list  # futures of evaluate- results ([] when not evaluated)
    records: tuple  # the strategy's log records of the round (strategies.base.Submitted)


class Attempt:
    """A try from ``start``: ``graph`` (its own key token), the strategy built on it, and what
    it has submitted: ``shards`` (augment futures by (round, i)), ``pending`` rounds, ``live``
    (the newest state). ``anchor`` moves on at each anchor round; ``replay``: the attempt
    replays rounds after lost work.
    """

    def __init__(self, graph: RoundGraph, strategy: Strategy, start: HostState, *, plan: list,
                 replay: bool):
        self.graph, self.strategy, self.plan = graph, strategy, plan
        self.start = self.anchor = start
        self.replay = replay
        self.K, self.batch_size = strategy.K, strategy.ctx.config.train.batch_size
        self.shards: dict = {}
        self.pending: list[Pending] = []
        self.live = None
        self.next_shard = start.round + 1  # first round whose shards are not submitted
        self._gathered: HostState | None = None

    def held(self) -> list:
        """The containers that hold the attempt's futures."""
        return [self.shards, self.pending, self.live]

    def clear(self) -> None:
        """Drop every future (after a failure: the next attempt starts from host state)."""
        self.shards.clear()
        self.pending.clear()
        self.live = None

    # ---- submitting --------------------------------------------------------------------------
    def begin(self, out) -> None:
        """Start from the anchor: the strategy restarts, the state goes to the cluster."""
        self.strategy.restart(self.start, self.shard, out, replay=self.replay)
        self.live = self.strategy.scatter(self.start)

    def submit(self, rnd, prefetch: int, eval_spec=None) -> None:
        """The strategy submits ``rnd`` from the newest state; with ``eval_spec`` the model after
        it is evaluated too (its evaluate- tasks go out with the round)."""
        self.prefetch(rnd.index + prefetch)
        submitted = self.strategy.submit_round(rnd, self.live, self.shard)
        self.live = submitted.live
        evals = []
        if eval_spec is not None:
            copies = self.strategy.model_copies(rnd, submitted.live)
            evals = self.graph.submit_evaluate(rnd.index, copies, eval_spec)
        self.pending.append(Pending(rnd, submitted.live, submitted.metrics, evals,
                                    tuple(submitted.records)))

    def due(self, anchors: bool) -> Iterator[Pending]:
        """The rounds to collect now: the oldest while two are in flight; every one when the
        newest is an anchor round."""
        while len(self.pending) > 1 or (anchors and self.pending):
            yield self.pending.pop(0)

    def prefetch(self, upto: int) -> None:
        """Submit every round's shards up to round ``upto``."""
        for index in range(self.next_shard, min(upto, len(self.plan) - 1) + 1):
            for k in range(self.K):
                self.shards[(index, k)] = self.graph.submit_augment(
                    self.plan[index], k, self.K, self.batch_size)
            self.next_shard = index + 1

    def shard(self, round_index: int, i: int):
        """The i-th shard of a round (handed over once: the consumer holds it from now on).

        A round at or before the anchor is submitted on demand: an async replica can still hold
        an earlier round's slot when the state is checkpointed."""
        self.prefetch(round_index)
        if (round_index, i) not in self.shards:
            self.shards[(round_index, i)] = self.graph.submit_augment(
                self.plan[round_index], i, self.K, self.batch_size)
        return self.shards.pop((round_index, i))

    # ---- anchors -----------------------------------------------------------------------------
    def state_after(self, pending: Pending) -> HostState:
        """The host state after a collected round (gathered once), checked finite."""
        if self._gathered is None or self._gathered.round != pending.rnd.index:
            state = self.strategy.gather(pending.rnd.index, pending.live)
            check_finite(state, pending.rnd)
            self._gathered = state
        return self._gathered

    def move_anchor(self, state: HostState, reroot: bool = True) -> None:
        """``state`` becomes the anchor; with ``reroot`` the rounds after it start from it
        scattered back as fresh roots, so the workers forget the rounds before it."""
        if reroot:
            self.live = self.strategy.reroot(state, self.live)
        self.anchor, self._gathered = state, None


def check_finite(state: HostState, rnd) -> None:
    """DivergenceError if the gathered state (after the average and the outer step, which no
    train task has seen yet) holds NaN or Inf: checked before it is saved or returned."""
    where = checkpoint.first_nonfinite(state)
    if where is not None:
        raise DivergenceError(f"training diverged in round {rnd.index} (epoch {rnd.epoch}): "
                              f"the averaged state's {where} is NaN or Inf (not saved; the last "
                              "good checkpoint stays the latest)")
