"""Stage seconds per round from the scheduler's task stream: pure accounting over its records.

Each record is ``{"key": ..., "startstops": [{"action": "compute", "start": s, "stop": t}]}``
(what ``client.get_task_stream`` returns). Compute time is charged to the stage and round in the
record's key (``pipeline.core.keys``); loading, keyed by block rather than by round, to the round
being collected. ``waiting`` is the wall time of a round that no task of it was computing.
"""
from __future__ import annotations

import time

import numpy as np

from pipeline.core import keys


def busy_seconds(intervals: list) -> float:
    """Length of the union of ``(start, stop)`` intervals.

    >>> busy_seconds([(0, 2), (1, 3), (5, 6)])
    4.0
    """
    busy, end = 0.0, -np.inf
    for lo, hi in sorted(intervals):
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
    return float(busy)


class StageClock:
    """Accumulates compute seconds by (round, stage); hands each round's figures out once."""

    def __init__(self, stages: tuple = keys.STAGES, load_seconds: float = 0.0,
                 first_round: int = 0, clock=time.perf_counter):
        self.stages, self.load_seconds, self.first_round = stages, load_seconds, first_round
        self.clock = clock
        self.by_round: dict[int, dict] = {}
        self.intervals: dict[int, list] = {}
        self.fetches: dict[int, int] = {}  # round -> its tasks' fetches from other workers
        self.last = clock()

    def account(self, records: list, collecting: int) -> None:
        """Add task-stream records; load- blocks are charged to round ``collecting``."""
        for rec in records:
            stage = keys.stage_of(rec.get("key"))
            if keys.is_block(rec.get("key")):  # keyed by block, not by round
                stage = "load"
            r = collecting if stage == "load" else keys.round_of(rec.get("key"))
            if r is None or stage not in self.stages:
                continue
            stages = self.by_round.setdefault(r, {})
            for ss in rec.get("startstops", ()):
                if ss.get("action") == "compute":
                    stages[stage] = stages.get(stage, 0.0) + ss["stop"] - ss["start"]
                    self.intervals.setdefault(r, []).append((ss["start"], ss["stop"]))
                elif ss.get("action") == "transfer":
                    self.fetches[r] = self.fetches.get(r, 0) + 1

    def transfers(self, r: int) -> int:
        """Round ``r``'s fetches of task inputs from another worker (a worker's gather from
        one other worker counts once: state and shards moving to a worker that joined, the
        averages' inputs). Forgets round ``r``.

        >>> clock = StageClock()
        >>> clock.account([{"key": ("train-0123abcd", 2, 1), "startstops": [
        ...     {"action": "transfer", "start": 0, "stop": 1}, {"action": "compute", "start": 1,
        ...     "stop": 2}]}], collecting=2)
        >>> clock.transfers(2), clock.transfers(2)
        (1, 0)
        """
        return self.fetches.pop(r, 0)

    def stage_seconds(self, r: int, shown: tuple) -> dict:
        """Round ``r``'s seconds per stage for the stages in ``shown`` (0.0 when none ran) and
        any other stage that ran in it (decode- in image-folder runs), plus ``waiting``; the
        run's load time goes to its first round. Forgets round ``r``."""
        ran = {s: round(v, 4) for s, v in self.by_round.pop(r, {}).items()}
        stages = {s: ran.get(s, 0.0) for s in self.stages if s in shown or s in ran}
        if r == self.first_round:
            stages["load"] = round(self.load_seconds + stages.get("load", 0.0), 4)
        busy = busy_seconds(self.intervals.pop(r, []))
        now = self.clock()
        wall, self.last = now - self.last, now
        stages["waiting"] = round(max(0.0, wall - busy), 4)
        return stages
