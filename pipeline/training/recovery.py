"""Fault recovery: a pure "replay or give up" decision, and the probes that feed and follow it.

The loop runs attempts from an anchor (the start, a resume, the last checkpoint). When one
fails, ``decide`` looks only at the exception, the cluster's state and the retry count: lost work
(a worker died with it) is replayed from the anchor by a fresh attempt; anything else, a lost
scheduler, or too many failures in a row end the run with one line that says where to go on.
The probes (``scheduler_alive``, ``forget``, ``await_workers``) ask the cluster; they import
distributed inside, so the decision stays importable without it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import NamedTuple

from pipeline.core.errors import ClusterError, UsageError, one_line

MAX_RETRIES = 3  # consecutive recoveries from lost work before the run gives up


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
           max_retries: int = MAX_RETRIES, kinds: tuple | None = None,
           suspect: str | None = None, lost_before: int | None = None) -> Replay | GiveUp:
    """Replay after lost work while the scheduler lives and fewer than ``max_retries`` replays
    failed in a row (``retries``: the failures before this one); otherwise give up.

    ``where``: the resume hint for the final message; ``stopped_in``: the round the driver was
    waiting for. A lost scheduler is never recoverable: it held every key. ``suspect``: the
    user's code that ran when a worker died ("model nets:Net's train task"; None: a worker
    left no one's code to blame, or the model is ours); ``lost_before``: the round the last
    failure in a row lost work in. A worker lost again in the same round after one replay is
    said as a death inside that code (a UsageError: replaying it again would die again).

    >>> from pipeline.core.errors import ClusterError
    >>> kinds = (OSError,)
    >>> decide(OSError("x"), ClusterState(True), 0, where="", stopped_in=3, kinds=kinds)
    Replay(retries=1)
    >>> print(decide(OSError("x"), ClusterState(False), 0, where="; no --out", stopped_in=3,
    ...              scheduler="tcp://h:1", kinds=kinds).error)
    lost the scheduler tcp://h:1 while waiting for round 3; no --out (and --scheduler ADDR for a new scheduler)
    >>> e = KeyError("bug"); decide(e, ClusterState(True), 0, where="", stopped_in=0, kinds=kinds).error is e
    True
    >>> print(decide(OSError("x"), ClusterState(True), 1, where="", stopped_in=2, kinds=kinds,
    ...              suspect="model nets:Net's train task", lost_before=2).error)
    worker died inside model nets:Net's train task, round 2, and again when it was replayed (its own code ended the worker's process: os._exit, a crash in native code, or the memory it took?)
    """
    kinds = kinds if kinds is not None else lost_work_types()
    if not isinstance(exc, kinds):
        return GiveUp(exc)  # a bug or a user error: the caller sees it unchanged
    if not cluster.scheduler_alive:
        hint = " (and --scheduler ADDR for a new scheduler)" if out_given else ""
        return GiveUp(ClusterError(f"lost the scheduler {scheduler} while waiting for round "
                                   f"{stopped_in}{where}{hint}"))
    if suspect is not None and lost_before == stopped_in:
        return GiveUp(UsageError(f"worker died inside {suspect}, round {stopped_in}, and again "
                                 f"when it was replayed (its own code ended the worker's "
                                 f"process: os._exit, a crash in native code, or the memory it "
                                 f"took?){where}"))
    retries += 1
    if retries > max_retries:
        return GiveUp(ClusterError(f"gave up after losing work {retries} times in a row, last "
                                   f"in round {stopped_in} ({one_line(exc)}){where}"))
    return Replay(retries)


def worker_changes(before: dict, after: dict) -> tuple[list, list]:
    """``(lost, restarted)`` worker names between two rosters ``{address: name}``: a name gone,
    or back at another address (its nanny started it again).

    >>> worker_changes({"tcp://a:1": "w0", "tcp://b:1": "w1"}, {"tcp://a:2": "w0"})
    (['w1'], ['w0'])
    """
    names_after = set(after.values())
    gone = sorted({name for address, name in before.items() if address not in after})
    return ([n for n in gone if n not in names_after], [n for n in gone if n in names_after])


_CAUSES = {"KilledWorker": "a task died with its workers",
           "FutureCancelledError": "inputs lost with a worker",
           "FuturesCancelledError": "inputs lost with a worker",
           "NoWorker": "no worker left may run its tasks"}


def replay_line(exc: BaseException, before: dict, after: dict, lost_in: int,
                anchor_round: int) -> str:
    """The one line a replay logs, in the run's words: which worker, which round, which rounds
    are computed again, on how many workers (rounds are the 0-based numbers of metrics.jsonl).

    >>> replay_line(OSError(), {"tcp://a:1": "w0", "tcp://b:1": "w1"}, {"tcp://b:1": "w1"}, 12, 9)
    'worker w0 lost in round 12: replaying rounds 10-12 on 1 worker'
    >>> replay_line(KeyError(), {"tcp://a:1": "w0"}, {"tcp://a:2": "w0"}, 3, 2)
    'worker w0 restarted by its nanny in round 3: replaying round 3 on 1 worker'
    >>> replay_line(OSError(), {}, {"x": "a", "y": "b"}, 0, -1)
    'work lost in round 0 (a worker connection closed): replaying round 0 on 2 workers'
    """
    lost, restarted = worker_changes(before, after)
    first = anchor_round + 1
    rounds = f"round {lost_in}" if first >= lost_in else f"rounds {first}-{lost_in}"
    n = len(after)
    on = f"on {n} worker{'s' if n != 1 else ''}"
    if lost or restarted:
        parts = ([f"worker{'s' if len(lost) > 1 else ''} {', '.join(lost)} lost"] if lost
                 else []) + ([f"worker{'s' if len(restarted) > 1 else ''} "
                              f"{', '.join(restarted)} restarted by its nanny"]
                             if restarted else [])
        return f"{' and '.join(parts)} in round {lost_in}: replaying {rounds} {on}"
    cause = _CAUSES.get(type(exc).__name__, "a worker connection closed"
                        if isinstance(exc, OSError) else type(exc).__name__)
    return f"work lost in round {lost_in} ({cause}): replaying {rounds} {on}"


def roster(client) -> dict:
    """``{address: name}`` of the workers the scheduler knows now ({} if it does not answer)."""
    try:
        workers = client.scheduler_info()["workers"]  # every worker (n_workers=-1)
    except Exception:  # a closed client or a scheduler that does not answer
        return {}
    return {address: str(w.get("name", address)) for address, w in workers.items()}


def resume_hint(out, anchor_round: int, has_checkpoint: bool, config=None) -> str:
    """``; <where the run can go on from>`` for the error that ends it.

    >>> resume_hint(None, 5, True)
    '; no --out was given, so there is nothing to resume'
    >>> resume_hint("runs/a", 9, True)
    '; the last checkpoint is round 9: resume with `python -m pipeline train --resume runs/a`'
    """
    if out is None:
        return "; no --out was given, so there is nothing to resume"
    if anchor_round >= 0 and has_checkpoint:
        return (f"; the last checkpoint is round {anchor_round}: resume with "
                f"`{resume_command(out, config)}`")
    return f"; no checkpoint yet: start again with --out {out} --overwrite"


def resume_command(out, config=None) -> str:
    """The command that goes on with run ``out``, with every option a resume needs: the user's
    model and optimizer named again (a run directory never imports code); for data given from Python, the
    Python call. ``config`` None: read from ``OUT/config.json`` (the defaults where unreadable).

    >>> from pipeline.core.config import Config
    >>> resume_command("runs/a", Config().replace(**{"model.name": "nets:Net"}))
    'python -m pipeline train --resume runs/a --model nets:Net'
    >>> resume_command("runs/a", Config().replace(**{"train.optimizer": "nets:opt"}))
    'python -m pipeline train --resume runs/a --optimizer nets:opt'
    >>> resume_command("runs/b", Config().replace(**{"data.dataset": "arrays"}))
    'train(config, data=<the same arrays>, resume=True) in Python (out=runs/b)'
    """
    from pipeline.backends import get_backend
    from pipeline.core.fields import is_import_path
    from pipeline.data.datasets import facts
    config = config if config is not None else _saved_config(out)
    if config is not None and not facts(config.data.dataset).refindable:
        return f"train(config, data=<the same arrays>, resume=True) in Python (out={out})"
    command = f"python -m pipeline train --resume {out}"
    name = config.model.name if config is not None else ""
    if name and name not in get_backend(config.model.backend).model_names():
        command += f" --model {name}"
    if config is not None and is_import_path(config.train.optimizer):
        command += f" --optimizer {config.train.optimizer}"
    return command


def _saved_config(out):
    from pipeline.core.errors import DataError
    from pipeline.outputs.fs import read_config
    try:
        return read_config(out, DataError)
    except DataError:
        return None


class ConnectionLossFilter(logging.Filter):
    """Drops distributed's own reports of a closed scheduler connection (tracebacks of
    CommClosedError, a cancelled reconnect) and of a lost worker (``WORKER_LOSS``): the driver
    reports each in one line."""

    keep = False  # stay installed after the run: the client's close still logs the loss

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (OSError, asyncio.CancelledError)):  # CommClosedError is an OSError
            return False
        return not str(record.msg).startswith(("Batched Comm Closed", "Failed to reconnect",
                                                *WORKER_LOSS))


# What the embedded cluster's scheduler and nannies say when a worker dies: the loop says it
# in one line of its own (``replay_line``, the roster lines), so theirs would repeat it in
# Dask's terms (task keys, stimulus ids), glued to the progress bar.
WORKER_LOSS = ("Restarting worker", "Removing worker", "Worker process ",
               "Received heartbeat from unregistered worker")

_QUIETED = ("distributed.batched", "distributed.client", "distributed.core", "distributed.utils",
            "distributed.comm.tcp", "distributed.nanny", "distributed.scheduler")


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


# ---- the cluster side of ``decide`` ---------------------------------------------------------
def scheduler_alive(client, timeout: float) -> bool:
    """The client is connected and the scheduler answers a ping within ``timeout`` s.

    A busy scheduler on a loaded machine (retiring a stopped worker, say) may miss one
    5-second ping, so pings are repeated until the time is up; a client reconnecting (its
    connection dropped, the scheduler alive) is waited for; a closed client is gone at once.
    """
    deadline = time.monotonic() + timeout
    while client.status in ("running", "connecting"):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if client.status == "connecting":
            time.sleep(min(0.1, left))
            continue
        try:
            client.sync(client.scheduler.identity, callback_timeout=min(5.0, left))
            return client.status == "running"
        except Exception:  # refused, closed, timed out: ask again while time is left
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    return False


def plain(value):
    """``value`` with every tuple subclass (a NamedTuple) rebuilt as a plain tuple, all the way
    down: ``distributed.futures_of`` descends into exact tuples, lists, sets and dicts only.

    >>> Pair = NamedTuple("Pair", [("a", object), ("b", object)])
    >>> plain([Pair([1], {"m": Pair(2, {3})})])
    [([1], {'m': (2, (3,))})]
    """
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, (tuple, set, frozenset)):
        return tuple(plain(v) for v in value)
    return value


def forget(held: list, exc: BaseException | None) -> None:
    """Release every future in ``held`` (a failed attempt's: the next one keys its tasks afresh);
    the scheduler drops what nobody else wants and stops the tasks still running. The
    traceback's frames of ``exc`` are cleared first: their locals hold futures of the attempt too.

    Released, not ``client.cancel``-ed: distributed's ``stimulus_cancel`` recurses into the
    dependents of a cancelled key and asserts that each is wanted by some client; an
    intermediate task held only through its own dependents (an ``apply-`` between two rounds)
    fails that assertion, the scheduler drops the client's connection, and with it forgets
    every key the client held, the persisted dataset too: every replay then died of "lost
    dependencies" (CI, test_async_lost_worker[arrival], about one run in five under load).
    """
    import traceback

    from pipeline.training.graph import futures_of
    stale = futures_of(plain(held))
    if exc is not None and exc.__traceback__ is not None:
        traceback.clear_frames(exc.__traceback__)
    for future in stale:
        with contextlib.suppress(Exception):  # a closed client: released with it anyway
            future.release()
    del stale


def await_workers(client, graph, timeout: float, log, *, replay_from: int, hint: str) -> None:
    """Before replaying from round ``replay_from``: at least one worker, and the train resource
    if ``graph`` (the run's ``RoundGraph``) asks for one (a lost worker's nanny restarts it). A
    CPU run whose training workers do not come back trains on the workers left, as it would have
    started on them (``graph.train_resources`` becomes None). ``hint``: where to go on, for the
    error that ends the run.
    """
    from pipeline.cluster import resources
    try:
        resources.require_workers(client, 1, timeout)
        for name in graph.train_resources or ():
            try:
                resources.require_resource(client, name, timeout, wait=True)
            except ClusterError:
                if graph.device != "cpu":
                    raise
                log(f"no worker advertises {name} any more: training on any worker")
                graph.train_resources = None
    except ClusterError as err:
        raise ClusterError(f"cannot replay from round {replay_from}: {err}{hint}") from None
