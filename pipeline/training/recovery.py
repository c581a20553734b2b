"""Fault recovery as values: what an attempt submitted, and a pure "replay or give up" decision.

The loop runs attempts from an anchor (the start, a resume, the last checkpoint). When one
fails, ``decide`` looks only at the exception, the cluster's state and the retry count: lost work
(a worker died with it) is replayed from the anchor by a fresh attempt; anything else, a lost
scheduler, or too many failures in a row end the run with one line that says where to go on.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import NamedTuple

from pipeline.core.errors import ClusterError, one_line

MAX_RETRIES = 3  # consecutive recoveries from lost work before the run gives up


class Attempt:
    """Everything one try from an anchor has submitted, so a failure can cancel it all.

    ``graph``: the attempt's ``RoundGraph`` (its own key token); ``shards``: augment futures by
    (round, i); ``pending``: rounds submitted but not collected; ``live``: the newest state;
    ``replay``: whether it replays after lost work.
    """

    def __init__(self, graph, anchor, replay: bool = False):
        self.graph, self.anchor, self.replay = graph, anchor, replay
        self.shards: dict = {}
        self.pending: list = []
        self.live = None

    def held(self) -> list:
        """The containers that hold the attempt's futures."""
        return [self.shards, self.pending, self.live]


class ClusterState(NamedTuple):
    scheduler_alive: bool  # connected, and the scheduler answers


class Replay(NamedTuple):
    retries: int  # failures in a row so far, this one included


class GiveUp(NamedTuple):
    error: BaseException  # what to raise (the exception itself when it is not the cluster's)


def lost_work_types() -> tuple:
    """Exceptions that mean work was lost with a worker (what a replay redoes).

    Distributed recomputes a lost key from its lineage by itself; what reaches the driver is
    what it cannot: a task that killed its workers (KilledWorker), keys forgotten because a
    scattered root or a dependency died with its worker (FutureCancelledError "already
    forgotten" / "lost dependencies"), a scatter to a worker that just died (OSError), tasks
    that no worker left may run (the watchdog's NoWorker: a ranked worker gone for good).
    """
    import distributed
    from distributed.client import FutureCancelledError, FuturesCancelledError

    from pipeline.cluster.watchdog import NoWorker
    return (distributed.KilledWorker, FutureCancelledError, FuturesCancelledError, OSError,
            NoWorker)


def decide(exc: BaseException, cluster: ClusterState, retries: int, *, where: str,
           stopped_in: int, scheduler: str = "?", out_given: bool = True,
           max_retries: int = MAX_RETRIES, kinds: tuple | None = None) -> Replay | GiveUp:
    """Replay after lost work while the scheduler lives and fewer than ``max_retries`` replays
    failed in a row (``retries``: the failures before this one); otherwise give up.

    ``where``: the resume hint for the final message; ``stopped_in``: the round the driver was
    waiting for. A lost scheduler is never recoverable: it held every key.

    >>> from pipeline.core.errors import ClusterError
    >>> kinds = (OSError,)
    >>> decide(OSError("x"), ClusterState(True), 0, where="", stopped_in=3, kinds=kinds)
    Replay(retries=1)
    >>> print(decide(OSError("x"), ClusterState(False), 0, where="; no --out", stopped_in=3,
    ...              scheduler="tcp://h:1", kinds=kinds).error)
    lost the scheduler tcp://h:1 while waiting for round 3; no --out (and --scheduler ADDR for a new scheduler)
    >>> e = KeyError("bug"); decide(e, ClusterState(True), 0, where="", stopped_in=0, kinds=kinds).error is e
    True
    """
    kinds = kinds if kinds is not None else lost_work_types()
    if not isinstance(exc, kinds):
        return GiveUp(exc)  # a bug or a user error: the caller sees it unchanged
    if not cluster.scheduler_alive:
        hint = " (and --scheduler ADDR for a new scheduler)" if out_given else ""
        return GiveUp(ClusterError(f"lost the scheduler {scheduler} while waiting for round "
                                   f"{stopped_in}{where}{hint}"))
    retries += 1
    if retries > max_retries:
        return GiveUp(ClusterError(f"gave up after losing work {retries} times in a row, last "
                                   f"in round {stopped_in} ({one_line(exc)}){where}"))
    return Replay(retries)


def resume_hint(out, anchor_round: int, has_checkpoints: bool) -> str:
    """``; <where the run can go on from>`` for the error that ends it.

    >>> resume_hint(None, 5, True)
    '; no --out was given, so there is nothing to resume'
    >>> resume_hint("runs/a", 9, True)
    '; the last checkpoint is round 9: resume with `python -m pipeline train --resume runs/a`'
    """
    if out is None:
        return "; no --out was given, so there is nothing to resume"
    if anchor_round >= 0 and has_checkpoints:
        return (f"; the last checkpoint is round {anchor_round}: resume with "
                f"`python -m pipeline train --resume {out}`")
    return f"; no checkpoint yet: start again with --out {out} --overwrite"


class ConnectionLossFilter(logging.Filter):
    """Drops distributed's own reports of a closed scheduler connection (tracebacks of
    CommClosedError, a cancelled reconnect): the driver reports a lost scheduler in one line."""

    keep = False  # stay installed after the run: the client's close still logs the loss

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (OSError, asyncio.CancelledError)):  # CommClosedError is an OSError
            return False
        return not str(record.msg).startswith(("Batched Comm Closed", "Failed to reconnect"))


_QUIETED = ("distributed.batched", "distributed.client", "distributed.core", "distributed.utils",
            "distributed.comm.tcp")


@contextlib.contextmanager
def quiet_connection_loss():
    """Install a ``ConnectionLossFilter`` on distributed's connection loggers for a run."""
    quiet = ConnectionLossFilter()
    loggers = [logging.getLogger(name) for name in _QUIETED]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield quiet
    finally:
        if not quiet.keep:
            for logger in loggers:
                logger.removeFilter(quiet)
