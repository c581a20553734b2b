"""Lost assignments: a task the scheduler has had ``processing`` for long on a worker that says
it is not computing it (it never heard of it) is assigned again.

The scheduler hands a task to a worker with one ``compute-task`` message and then waits for the
worker's answer. Once in a while (about 1 fault-test run in 5 on distributed 2026.8.0, after two
workers were killed one after the other) the answer never comes: the scheduler lists a dataset
block as processing on the one live worker, the worker has no state for it, nothing executes
and nothing times out, so the run waits forever. The worker had been fetching the block from a
killed worker for a dependent task; asked to compute it, then told to free the dependent, it
cancels the block and forgets it when the fetch fails (distributed's worker state machine does
this; ``tests/cluster/test_assignments.py`` drives it there). A lost ``compute-task`` message
ends the same. Neither the worker's heartbeat (it is alive) nor its executing figures (it runs
nothing) show it; only asking the worker does.

:class:`Watchdog <pipeline.cluster.watchdog.Watchdog>` asks between its slices: :func:`assigned` (on the
scheduler) lists the tasks the run waits on that are processing on a live worker, including the
dataset's blocks and anything else of another token the run depends on; :func:`states` (on
each of those workers) says what the worker knows of them; :func:`track` and :func:`due` (pure)
keep, per (key, worker), since when the worker has said it is not computing the task, and name
those it has said so for longer than the limit. :func:`reschedule` (on the scheduler) then
releases the task there, as a worker does for its own ``Reschedule``: the scheduler assigns it
again, to whichever worker fits, with a fresh ``compute-task``.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NamedTuple

from pipeline.core import keys

# A worker's own states of a task it is not computing: None (no state at all: it never got the
# task, or forgot it), "released" (let go, about to be forgotten) and "fetch"/"flight"/"missing"
# (it waits to receive the value from another worker, while the scheduler, which lists no one
# holding it, waits for this worker to compute it). Every other state (waiting, ready,
# constrained, executing, long-running, memory, error, cancelled, resumed) is the worker at work
# or an answer on its way: never judged, however long.
NOT_COMPUTING = (None, "released", "fetch", "flight", "missing")
FLOOR_S = 2.0  # never sooner: a compute-task message takes milliseconds, a look ~1 ms
ASK_S = 2.0  # seconds to wait for the workers' answers; none in time: no evidence this look
HEARD_S = 5.0  # ask only workers heard from this recently (a stopped one would never answer)


class Lost(NamedTuple):
    """A task the scheduler has processing on ``worker`` and ``worker`` is not computing."""
    key: object  # the task key itself (a tuple), as the scheduler and the worker name it
    worker: str  # worker address
    seconds: float  # the worker has said so for this long


def track(since: dict, answers: Iterable[tuple], now: float) -> dict:
    """``{(key, worker): first time the worker said it is not computing the task}`` after a look.

    ``answers``: ``(key, worker, state)`` for the tasks processing on a worker, ``state`` the
    worker's own (None: unknown to it). A pair the worker computes, or that was not asked this
    look, leaves the record: only an unbroken run of "not computing" answers counts.

    >>> lost, queued = (("images-ab", 4), "tcp://w", None), (("train-cd", 0), "tcp://w", "ready")
    >>> s = track({}, [lost, queued], 10.0); s
    {(('images-ab', 4), 'tcp://w'): 10.0}
    >>> track(s, [(("images-ab", 4), "tcp://w", None)], 14.0) == s
    True
    >>> track(s, [(("images-ab", 4), "tcp://w", "executing")], 14.0)
    {}
    """
    out = {}
    for key, worker, state in answers:
        if state in NOT_COMPUTING:
            out[(key, worker)] = since.get((key, worker), now)
    return out


def due(since: dict, now: float, limit: float) -> list[Lost]:
    """The pairs not computed for longer than ``max(limit, FLOOR_S)`` seconds, longest first.

    >>> due({(("images-ab", 4), "tcp://w"): 10.0}, 70.5, 60.0)
    [Lost(key=('images-ab', 4), worker='tcp://w', seconds=60.5)]
    >>> due({(("images-ab", 4), "tcp://w"): 10.0}, 11.0, 0.0)  # the floor
    []
    """
    limit = max(limit, FLOOR_S)
    found = [Lost(key, worker, now - t) for (key, worker), t in since.items() if now - t > limit]
    return sorted(found, key=lambda x: (-x.seconds, str(x.key)))


def describe(lost: Lost, state: str | None = None) -> str:
    """The log line for a lost assignment being assigned again.

    >>> describe(Lost(("images-ab", 4, 0, 0, 0), "tcp://w1", 61.2))
    ... # doctest: +NORMALIZE_WHITESPACE
    "lost assignment: ('images-ab', 4, 0, 0, 0) has been processing on tcp://w1 for 61 s but
     the worker has no state for it; assigning it again"
    """
    said = "has no state for it" if state is None else f"has it as {state}"
    return (f"lost assignment: {lost.key} has been processing on {lost.worker} for "
            f"{lost.seconds:.0f} s but the worker {said}; assigning it again")


# ---------------------------------------------------------------------------------------------
# The Dask side (attribute access only: this module imports no dask)


def ours(key, suffix: str) -> bool:
    """Whether ``key`` is a task of the run whose key prefixes end with ``suffix``.

    >>> ours(("train-ab12", 3, 1), "-ab12"), ours(("load-cd34", 0), "-ab12"), ours("x", "-ab12")
    (True, False, False)
    """
    return keys.stage_in_run(key, suffix) is not None


def assigned(suffix: str, dask_scheduler=None, heard_s: float = HEARD_S) -> list[tuple]:
    """Runs on the scheduler: ``(key, worker)`` of the tasks the run waits on that are
    processing on a worker heard from in the last ``heard_s`` seconds.

    The run waits on its own unfinished keys (prefix ending with ``suffix``) and, through the
    dependencies they still wait for, on keys of other tokens: the dataset's blocks, a resumed
    anchor. Silent workers are the stalled-task watchdog's (``watchdog.executing``)."""
    now = time.time()
    todo = [ts for ts in dask_scheduler.tasks.values()
            if ts.state in ("waiting", "processing") and ours(ts.key, suffix)]
    seen, found = set(), []
    while todo:
        ts = todo.pop()
        if id(ts) in seen:
            continue
        seen.add(id(ts))
        if ts.state == "processing":
            ws = ts.processing_on
            if ws is not None and now - ws.last_seen < heard_s:
                found.append((ts.key, ws.address))
        elif ts.state == "waiting":
            todo.extend(ts.waiting_on or ())
    return found


def states(keys_by_worker: dict, dask_worker=None) -> dict:
    """Runs on a worker: ``{key: the worker's state of it, or None}`` for its keys in
    ``keys_by_worker`` (``{worker address: [key, ...]}``, one message for every worker)."""
    tasks = dask_worker.state.tasks
    return {key: (tasks[key].state if key in tasks else None)
            for key in keys_by_worker.get(dask_worker.address, ())}


def reschedule(key, worker: str, dask_scheduler=None) -> bool:
    """Runs on the scheduler: release ``key`` if it is still processing on ``worker``, so it is
    assigned again (a worker's ``reschedule`` message, the one a task raising
    ``distributed.Reschedule`` sends). Returns whether it was still there to release."""
    ts = dask_scheduler.tasks.get(key)
    if ts is None or ts.state != "processing" or ts.processing_on is None \
            or ts.processing_on.address != worker:
        return False  # it finished, moved or was released meanwhile: nothing lost any more
    dask_scheduler.stream_handlers["reschedule"](
        key=key, worker=worker, stimulus_id=f"lost-assignment-watchdog-{time.time()}")
    return True
