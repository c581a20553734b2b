"""The stalled-task watchdog: a task running far longer than its peers is reported, and past a
limit its worker is retired so the work is replayed elsewhere.

Distributed notices a dead worker at once (its connection closes) but a stopped one (SIGSTOP, a
hung NFS read, a machine paging itself to death) only after ``worker-ttl`` (5 minutes, checked
every 5): its tasks wait with it. The driver waits for a round in short slices; between slices
:class:`Watchdog` asks the scheduler how long each task of this run has been executing (the
worker's own figure at its last heartbeat, plus the time since that heartbeat: a stopped worker's
tasks keep ageing) and :func:`judge` compares that with the median of the stage's finished tasks:

* past ``max(stall_min_s, stall_report x median)``: one log line naming the task and worker;
* past ``max(stall_min_s x stall_retire / stall_report, stall_retire x median)``: the worker is
  removed from the scheduler. Its tasks are rescheduled on the others and whatever it held is
  recomputed from lineage or, for the scattered state, replayed from the last anchor by the
  driver's recovery. Every value is keyed by seed and coordinates, so the result is unchanged.

The same look also catches a task that waits without anything being slow: one the scheduler has
processing on a live worker that has forgotten it or never got it. That worker is asked what it
knows of it; a task it has not been computing for ``stall_min_s`` is assigned again
(:mod:`pipeline.cluster.assignments`).

:func:`judge` is pure; :class:`Watchdog` is the Dask side.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from pipeline.cluster import assignments
from pipeline.core import keys
from pipeline.core.errors import one_line

PEERS = 64  # finished task durations remembered per stage
POLL_S = 1.0  # how often the driver looks while it waits (one scheduler round trip, ~1 ms)


class Running(NamedTuple):
    """A task of this run executing on a worker."""
    key: str  # str(task key)
    stage: str  # key prefix: train, augment, average, ...
    worker: str  # worker address
    seconds: float  # executing for this long (heartbeat figure + time since that heartbeat)


class Verdict(NamedTuple):
    action: str  # "report" | "retire"
    task: Running
    median: float | None  # of the stage's finished peers, None without any
    limit: float  # seconds past which the action was taken


def thresholds(median: float | None, report: float, retire: float, floor: float
               ) -> tuple[float, float | None]:
    """(report after, retire after) in seconds for a stage whose finished tasks took ``median``.

    >>> thresholds(2.0, 5.0, 20.0, 60.0), thresholds(30.0, 5.0, 20.0, 60.0)
    ((60.0, 240.0), (150.0, 600.0))
    >>> thresholds(None, 5.0, 0.0, 60.0)
    (60.0, None)
    """
    base = median or 0.0
    report_at = max(floor, report * base)
    retire_at = None if retire == 0 else max(floor * retire / report, retire * base)
    return report_at, retire_at


def judge(running: Sequence[Running], medians: dict, report: float, retire: float,
          floor: float, reported: set, retired: set) -> list[Verdict]:
    """What to do about the running tasks: at most one verdict per worker and look, for its
    longest-running task; a task is reported once, a worker retired once.

    ``medians``: {stage: median seconds of its finished tasks}; ``reported``/``retired``: keys
    and workers already acted on (not repeated).

    >>> slow = Running("('train-ab', 3, 1)", "train", "tcp://w1", 70.0)
    >>> [v.action for v in judge([slow], {"train": 2.0}, 5, 20, 60, set(), set())]
    ['report']
    >>> [v.action for v in judge([slow._replace(seconds=250.0)], {"train": 2.0}, 5, 20, 60,
    ...                          {slow.key}, set())]
    ['retire']
    """
    verdicts, judged = [], set()
    for task in sorted(running, key=lambda t: (-t.seconds, t.key)):  # one verdict per worker
        if task.worker in judged or task.worker in retired:
            continue
        median = medians.get(task.stage)
        report_at, retire_at = thresholds(median, report, retire, floor)
        if retire_at is not None and task.seconds > retire_at:
            verdicts.append(Verdict("retire", task, median, retire_at))
            judged.add(task.worker)
        elif task.seconds > report_at and task.key not in reported:
            verdicts.append(Verdict("report", task, median, report_at))
            judged.add(task.worker)
    return verdicts


def describe(v: Verdict) -> str:
    """The log line of a verdict.

    >>> describe(Verdict("report", Running("('train-ab', 3, 1)", "train", "tcp://w1", 70.4),
    ...                  2.0, 60.0))  # doctest: +NORMALIZE_WHITESPACE
    "stalled? ('train-ab', 3, 1) has run 70 s on tcp://w1; its finished peers took 2.0 s
     (median); waiting"
    """
    peers = (f"its finished peers took {v.median:.1f} s (median)" if v.median is not None
             else "no peer has finished yet")
    head = f"{v.task.key} has run {v.task.seconds:.0f} s on {v.task.worker}; {peers}"
    if v.action == "report":
        return f"stalled? {head}; waiting"
    return (f"stalled: {head}; retiring worker {v.task.worker} so its work is replayed "
            "elsewhere")


# ---------------------------------------------------------------------------------------------
# The Dask side


def executing(suffix: str, dask_scheduler=None) -> list[tuple]:
    """Runs on the scheduler: ``(key, stage, worker, seconds)`` of the tasks whose key prefix
    ends with ``suffix`` (``-<run token>``) and that a worker executes or, silent since, held."""
    now = time.time()
    found = []
    for ws in dask_scheduler.workers.values():
        silent = max(0.0, now - ws.last_seen)
        seen = set()
        for ts, seconds in ws.executing.items():
            found.append((ts.key, seconds + silent, ws.address))
            seen.add(ts.key)
        if silent > assignments.HEARD_S:  # stopped before a heartbeat said it started
            found.extend((ts.key, silent, ws.address) for ts in ws.processing if ts.key not in seen)
            seen.update(ts.key for ts in ws.processing)
            # results it holds: a driver gathering them (a checkpoint's state) waits on a silent
            # worker with no task running anywhere
            found.extend((ts.key, silent, ws.address) for ts in ws.has_what if ts.key not in seen)
    out = []
    for key, seconds, worker in found:
        stage = keys.stage_in_run(key, suffix)
        if stage is not None:
            out.append((str(key), stage, worker, float(seconds)))
    return out


def unrunnable(suffix: str, dask_scheduler=None) -> list[tuple]:
    """Runs on the scheduler: ``(key, seconds, resources)`` of the run's tasks that no connected
    worker may run (distributed's "no-worker" state), e.g. ones that ask for the ``RANK-i`` of a
    worker that is gone, with how long they have waited and what they ask for."""
    now = time.monotonic()  # distributed times ``unrunnable`` on the monotonic clock
    return [(str(ts.key), now - since, dict(ts.resource_restrictions or {}))
            for ts, since in getattr(dask_scheduler, "unrunnable", {}).items()
            if assignments.ours(ts.key, suffix)]


def survey(suffix: str, dask_scheduler=None) -> tuple[list, list, list]:
    """Runs on the scheduler: one look's :func:`executing` rows, :func:`assignments.assigned`
    pairs and :func:`unrunnable` rows (one round trip for all)."""
    return (executing(suffix, dask_scheduler=dask_scheduler),
            assignments.assigned(suffix, dask_scheduler=dask_scheduler),
            unrunnable(suffix, dask_scheduler=dask_scheduler))


async def remove_worker(address: str, dask_scheduler=None) -> str:
    """Runs on the scheduler: drop ``address`` now (its tasks go back to be scheduled elsewhere)."""
    return await dask_scheduler.remove_worker(address=address, close=True,
                                              stimulus_id=f"stalled-task-watchdog-{time.time()}")


class NoWorker(RuntimeError):
    """Tasks of the run that no connected worker may run: work lost with a worker."""


def _quiet_dropped_fetches(loop) -> None:
    """Drop asyncio's "Task exception was never retrieved" for distributed's ``AllExit`` on
    ``loop`` (once per loop; other reports go to the handler there was). A cancelled ``_gather``
    leaves the helper tasks it waited through running; when a future they watch errs (the
    retired worker's result), each raises ``AllExit``, distributed's own signal to stop waiting,
    to nobody, and asyncio printed it with a traceback at the end of a run that went on fine."""
    from distributed.client import AllExit
    previous = loop.get_exception_handler()
    if getattr(previous, "drops_all_exit", False):
        return

    def handler(loop, context: dict) -> None:
        if isinstance(context.get("exception"), AllExit):
            return
        if previous is None:
            loop.default_exception_handler(context)
        else:
            previous(loop, context)
    handler.drops_all_exit = True
    loop.set_exception_handler(handler)


class Watchdog:
    """Waits for futures in slices of ``POLL_S`` and judges the run's tasks in between.

    ``cfg`` is the cluster section (``stall_report``, ``stall_retire``, ``stall_min_s``); each
    wait names the key suffix of the tasks it may judge (``-<token>`` of the attempt), so tasks
    of other runs on a shared scheduler are never touched; a lost assignment may also be a key
    of another token that such a task waits for (the dataset's blocks).
    """

    def __init__(self, client, cfg, log: Callable[[str], None], poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic, executor=None):
        self.client, self.cfg, self.log, self.poll_s = client, cfg, log, poll_s
        self.clock = clock  # seconds; lost assignments are timed by it
        self.executor = executor  # asks the workers (one thread, made on first use)
        self.asking = None  # concurrent.futures.Future of the question in flight
        self.peers: dict[str, deque] = {}
        self.reported: set = set()
        self.retired: set = set()
        self.idle: dict = {}  # {(key, worker): since when the worker has not been computing it}
        self.enabled = True

    def observe(self, stage: str, seconds: float) -> None:
        """A finished task of ``stage`` took ``seconds`` (its compute time)."""
        self.peers.setdefault(stage, deque(maxlen=PEERS)).append(float(seconds))

    def medians(self) -> dict:
        return {stage: statistics.median(d) for stage, d in self.peers.items() if d}

    def wait(self, futures, suffix: str, first: bool = False) -> None:
        """Return once every future (``first``: one of them) is finished or erred; look at the
        run's tasks between slices."""
        from distributed.client import ALL_COMPLETED, FIRST_COMPLETED, _wait
        pending = [f for f in futures if f is not None]
        while pending:
            try:  # distributed.wait() needs a default client; this one may not be
                self.client.sync(_wait, pending, timeout=self.poll_s,
                                 return_when=FIRST_COMPLETED if first else ALL_COMPLETED)
                return
            except TimeoutError:
                self.check(suffix)

    def gather(self, futures, suffix: str):
        """``client.gather(futures)``, looking at the run's tasks every ``poll_s`` while it runs.

        The fetch itself needs the look as much as the compute does: a worker stopped after its
        task ended still accepts the connection (its kernel does) and never answers, and
        distributed reads with no timeout. Once a look retires a worker the fetch in flight is
        dropped and a new one starts; it waits for what the retired worker held to be computed
        again, or raises for what cannot be (scattered state: recovery's to replay)."""
        while True:
            job = asyncio.run_coroutine_threadsafe(self.client._gather(futures),
                                                   self.client.loop.asyncio_loop)
            try:
                while True:
                    try:
                        return job.result(timeout=self.poll_s)
                    except TimeoutError:  # concurrent.futures' is the builtin since 3.11
                        if any(v.action == "retire" for v in self.check(suffix)):
                            break
            finally:
                if not job.done():
                    _quiet_dropped_fetches(self.client.loop.asyncio_loop)
                job.cancel()  # a no-op once it has finished

    def check(self, suffix: str) -> list[Verdict]:
        """One look: ask the scheduler, judge, log and retire; assign lost tasks again. Returns
        the verdicts acted on."""
        if not self.enabled:
            return []
        try:
            rows, pairs, stuck = self.client.run_on_scheduler(survey, suffix)
        except Exception as exc:  # e.g. a scheduler that cannot import this package
            self.enabled = False
            self.log(f"stalled-task watchdog off: the scheduler cannot run it "
                     f"({one_line(exc, limit=160)})")
            return []
        c = self.cfg
        verdicts = judge([Running(*row) for row in rows], self.medians(), c.stall_report,
                         c.stall_retire, c.stall_min_s, self.reported, self.retired)
        for v in verdicts:
            self.log(describe(v))
            self.reported.add(v.task.key)
            if v.action == "retire":
                self.retired.add(v.task.worker)
                try:
                    self.client.run_on_scheduler(remove_worker, v.task.worker)
                except Exception as exc:  # gone already: nothing left to retire
                    self.log(f"could not retire {v.task.worker}: {type(exc).__name__}: {exc}")
        self.reassign(pairs)
        self._no_worker(stuck)
        return verdicts

    def _no_worker(self, stuck: list) -> None:
        """A task no connected worker may run for ``max(stall_min_s, connect_timeout)`` seconds
        (its ranked worker retired or gone for good) ends the attempt as lost work: the replay
        places the replicas on the workers there are then."""
        limit = max(self.cfg.stall_min_s, self.cfg.connect_timeout)
        over = [(key, seconds, needs) for key, seconds, needs in stuck if seconds > limit]
        if over:
            key, seconds, needs = max(over, key=lambda x: x[1])
            wanted = " ".join(f"{k}={v:g}" for k, v in sorted(needs.items())) or "nothing"
            raise NoWorker(f"{key} has waited {seconds:.0f} s for a worker offering {wanted}; "
                           "no connected worker does")

    def reassign(self, pairs: list) -> list[assignments.Lost]:
        """Ask the workers of ``pairs`` (``(key, worker)`` processing there, from
        :func:`assignments.assigned`) what they know of them, in the background: a look never
        waits for a worker (a stopped one would not answer). Judge the answers of the last
        question, if back: a task a worker has not been computing for ``cluster.stall_min_s``
        is assigned again. Returns those tasks."""
        lost = []
        if self.asking is not None and self.asking.done():
            sent, answers = self.asking.result()
            self.asking = None
            if answers is not None:  # None: no answer in time, no evidence either way
                lost = self._judge_answers(sent, answers)
        if not pairs:
            self.idle = {}  # nothing processing: a task seen later starts afresh
        elif self.asking is None:  # one question at a time: answers come back in order
            by_worker: dict[str, list] = {}
            for key, worker in pairs:
                by_worker.setdefault(worker, []).append(key)
            if self.executor is None:
                self.executor = ThreadPoolExecutor(1, thread_name_prefix="watchdog-ask")
            self.asking = self.executor.submit(self._ask, by_worker, self.clock())
        return lost

    def _judge_answers(self, sent: float, answers: list) -> list[assignments.Lost]:
        """Track the answers to the question sent at ``sent``; assign the overdue again."""
        self.idle = assignments.track(self.idle, answers, sent)
        states = {(key, worker): state for key, worker, state in answers}
        lost = assignments.due(self.idle, sent, self.cfg.stall_min_s)
        for x in lost:
            self.log(assignments.describe(x, states[(x.key, x.worker)]))
            self.idle[(x.key, x.worker)] = sent  # not again before another full limit
            try:
                self.client.run_on_scheduler(assignments.reschedule, x.key, x.worker)
            except Exception as exc:  # the scheduler went away: recovery's to judge
                self.log(f"could not assign {x.key} again: {type(exc).__name__}: {exc}")
        return lost

    def _ask(self, by_worker: dict, sent: float) -> tuple[float, list | None]:
        """``(sent, [(key, worker, the worker's state of it or None)])``; a worker that did not
        answer leaves its keys out; None when none answered within ``assignments.ASK_S``."""
        try:  # Client.run has no timeout; a worker stopped since its last heartbeat never answers
            replies = self.client.sync(self.client._run, assignments.states, by_worker,
                                       workers=list(by_worker), on_error="return",
                                       callback_timeout=assignments.ASK_S)
        except Exception:  # timed out, or the client closed: ask again later
            return sent, None
        return sent, [(key, worker, replies[worker].get(key, None))
                      for worker, keys in by_worker.items()
                      if isinstance(replies.get(worker), dict) for key in keys]
