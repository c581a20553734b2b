"""Elastic runs: the training workers at each round boundary, who joined and who left since the
last one, and the attempt's replicas placed again where they changed (a worker that joined
trains from the next round; one Dask retires hands its replicas over, with no replay).

Placement decides where tasks run, never what they compute, so a run that grows or shrinks ends
with the bits of a run on a fixed cluster of any size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pipeline.training.graph import RoundGraph


def workers_field(before: dict | None, now: dict) -> dict:
    """A round's ``workers`` field of metrics.jsonl: how many training workers its tasks were
    placed over, their names, and the names that joined or left since the round before
    (``before``; None: the first round of this run). Rosters are ``{address: name}``.

    >>> workers_field({"tcp://a:1": "0"}, {"tcp://a:1": "0", "tcp://b:1": "1"})
    {'count': 2, 'names': ['0', '1'], 'joined': ['1']}
    >>> workers_field({"tcp://a:1": "0", "tcp://b:1": "1"}, {"tcp://b:1": "1"})
    {'count': 1, 'names': ['1'], 'left': ['0']}
    >>> workers_field(None, {"tcp://a:1": "0"})
    {'count': 1, 'names': ['0']}
    """
    field = {"count": len(now), "names": sorted(now.values())}
    if before is not None:
        joined = sorted(n for a, n in now.items() if a not in before)
        left = sorted(n for a, n in before.items() if a not in now)
        field.update({k: v for k, v in (("joined", joined), ("left", left)) if v})
    return field


def change_line(field: dict, round_index: int, replicas: int) -> str:
    """The line a run logs where its workers changed at a round boundary.

    >>> change_line({"count": 3, "names": ["0", "1", "2"], "joined": ["1", "2"]}, 3, 3)
    'workers changed before round 3 (joined: 1, 2): 3 replicas placed over 3 workers'
    >>> change_line({"count": 1, "names": ["0"], "left": ["1"]}, 4, 2)
    'workers changed before round 4 (left: 1): 2 replicas placed over 1 worker'
    """
    what = "; ".join(f"{k}: {', '.join(field[k])}" for k in ("joined", "left") if k in field)
    n = field["count"]
    return (f"workers changed before round {round_index} ({what}): {replicas} replicas placed "
            f"over {n} worker{'s' if n != 1 else ''}")


def training_roster(client) -> dict:
    """``{address: name}`` of the workers a placement may use now (those Dask is not retiring;
    not those without the train resources either: ``placement.place`` reads the same);
    {} when the scheduler does not answer."""
    from pipeline.cluster.resources import staying
    try:
        workers = staying(client.scheduler_info(n_workers=-1)["workers"])
    except Exception:  # noqa: BLE001  a closed client: the loop's recovery says what happened
        return {}
    return {address: str(w.get("name", address)) for address, w in workers.items()}


class Membership:
    """The workers each round was placed over. ``boundary`` runs before a round is submitted:
    one ``scheduler_info`` call (the scheduler's own roster, no task); where the workers
    changed, the attempt's graph places its replicas again."""

    def __init__(self, client, log: Callable[[str], None], replicas: int):
        self.client, self.log, self.replicas = client, log, replicas
        self.seen: dict | None = None  # the roster the last boundary placed over
        self.fields: dict = {}  # round -> its ``workers`` field, until its line is made

    def boundary(self, graph: RoundGraph, round_index: int) -> None:
        now = training_roster(self.client)
        if not now:  # no answer, or no worker: the round's own wait reports it
            now = self.seen or {}
        field = workers_field(self.seen, now)
        if self.seen is not None and set(now) != set(self.seen):
            graph.replace()
            self.log(change_line(field, round_index, self.replicas))
        self.fields[round_index] = field
        self.seen = now

    def field(self, round_index: int) -> dict:
        """Round ``round_index``'s ``workers`` field (read once, when its line is made)."""
        return self.fields.pop(round_index, {"count": len(self.seen or ())})
