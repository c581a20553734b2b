"""When a round is evaluated, checkpointed or made an anchor: pure functions of the plan's rounds
(what Chainer's ``IntervalTrigger`` is to its iterations).
"""
from __future__ import annotations

from typing import NamedTuple


def every(n: int, index: int) -> bool:
    """Whether round ``index`` (0-based) ends a block of ``n`` rounds; never for ``n <= 0``.

    >>> [i for i in range(7) if every(3, i)], every(0, 5)
    ([2, 5], False)
    """
    return n > 0 and (index + 1) % n == 0


class Schedule(NamedTuple):
    """The run's triggers, from its config and plan."""
    rounds: int  # rounds in the plan
    eval_every: int  # also evaluate every N rounds (epoch ends and the last round always)
    checkpoint_every: int  # checkpoint every N rounds (the last round always)
    anchor_every: int  # an anchor at most N rounds after the last one (0: checkpoints only)
    saves: bool  # the run has an output directory (else nothing is checkpointed)

    @classmethod
    def of(cls, config, rounds: int, saves: bool) -> "Schedule":
        return cls(rounds, config.eval_every, config.checkpoint_every, config.anchor_every, saves)

    def last(self, rnd) -> bool:
        return rnd.index == self.rounds - 1

    def evaluates(self, rnd) -> bool:
        """Epoch ends, the last round and every ``eval_every``-th round are evaluated.

        >>> from pipeline.core.schedule import Round
        >>> s = Schedule(rounds=8, eval_every=0, checkpoint_every=3, anchor_every=0, saves=True)
        >>> [r for r in range(8) if s.evaluates(Round(r, r // 4, 0, 1, r, True, r % 4 == 3))]
        [3, 7]
        """
        return rnd.epoch_end or self.last(rnd) or every(self.eval_every, rnd.index)

    def checkpoints(self, rnd) -> bool:
        """Every ``checkpoint_every``-th round and the last one, when the run saves.

        >>> from pipeline.core.schedule import Round
        >>> s = Schedule(rounds=8, eval_every=0, checkpoint_every=3, anchor_every=0, saves=True)
        >>> [r for r in range(8) if s.checkpoints(Round(r, 0, r, 1, r, True, False))]
        [2, 5, 7]
        >>> s._replace(saves=False).checkpoints(Round(7, 0, 7, 1, 7, True, False))
        False
        """
        return self.saves and (self.last(rnd) or every(self.checkpoint_every, rnd.index))

    def anchors(self, rnd, anchor_round: int) -> bool:
        """Whether the state after ``rnd`` becomes the anchor a replay goes back to (gathered
        before the next round is submitted): a checkpoint, the last round, or ``anchor_every``
        rounds after the last anchor. Cutting the lineage there keeps each worker's records
        bounded (docs/reliability.md).

        >>> from pipeline.core.schedule import Round
        >>> s = Schedule(rounds=20, eval_every=0, checkpoint_every=0, anchor_every=4, saves=True)
        >>> s.anchors(Round(6, 0, 6, 1, 6, True, False), 2), s.anchors(Round(6, 0, 6, 1, 6, True,
        ...                                                            False), 3)
        (True, False)
        """
        return (self.checkpoints(rnd) or self.last(rnd)
                or (self.anchor_every > 0 and rnd.index - anchor_round >= self.anchor_every))
