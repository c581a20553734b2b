"""Stopping a run on request: SIGINT (Ctrl-C) or SIGTERM (a batch scheduler) asks the driver to stop
at the next round boundary with a checkpoint; a second signal stops it at once.

The driver only reads a :class:`StopRequest` (``requested``) between rounds; the signal handlers
that set it are installed by :func:`graceful_stop` around a run (the CLI does), never by the
driver, so notebooks keep their own Ctrl-C. Worker processes of an embedded cluster ignore both
signals (:func:`signals_ignored` around their start): a terminal's Ctrl-C goes to the whole
process group, and the driver, not the workers, decides when they stop.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Whether (and by which signal) a stop was asked for; set by a handler or by ``request``.

    >>> stop = StopRequest()
    >>> stop.requested, stop.exit_status
    (False, 0)
    >>> stop.request(signal.SIGTERM)
    >>> stop.requested, stop.exit_status, stop.name
    (True, 143, 'SIGTERM')
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        # True while the run is still being set up (the CLI sets it; the driver clears it when
        # it starts reading the request between rounds): a signal then stops at once, so a
        # blocking call of the set-up (a read, a connect) never makes the run unkillable.
        self.in_setup = False

    def request(self, signum: int = signal.SIGINT) -> None:
        if self.signum is None:
            self.signum = int(signum)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_status(self) -> int:
        """The shell's status for death by the signal: 128 + its number (130 SIGINT, 143 SIGTERM)."""
        return 128 + self.signum if self.signum is not None else 0

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


class ForcedStop(KeyboardInterrupt):
    """A second signal, or one during set-up: stop now, without waiting for a round boundary.
    ``line`` is the one line to print."""

    def __init__(self, signum: int, in_setup: bool = False):
        name = signal.Signals(signum).name
        super().__init__(name)
        self.exit_status = 128 + int(signum)
        self.in_setup = in_setup
        self.line = (f"error: interrupted ({name}) while the run was being set up; no round "
                     "ran and nothing was written" if in_setup else
                     "error: interrupted; a run stops cleanly at the next round boundary after "
                     "one Ctrl-C (or SIGTERM), a second one stops it at once")


@contextlib.contextmanager
def graceful_stop(signals=HANDLED) -> Iterator[StopRequest]:
    """Install handlers for ``signals`` for the block; yield the :class:`StopRequest` they set.

    The first signal only sets the request; the next raises :class:`ForcedStop` in the main thread,
    and so does the first while ``stop.in_setup``.
    Outside the main thread (where Python cannot install handlers) the request is returned unarmed.
    """
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    levels: dict = {}  # distributed's log levels before a forced stop quieted them

    def handler(signum, frame):
        if stop.requested or stop.in_setup:
            quiet_abandoned_gathers()
            if stop.requested:  # the cluster closes mid-task: its warnings are not news
                for name, level in quiet_cluster_logs().items():
                    levels.setdefault(name, level)
            raise ForcedStop(signum, in_setup=stop.in_setup and not stop.requested)
        stop.request(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        for name, level in levels.items():  # the block (and the cluster it ran) has ended
            logging.getLogger(name).setLevel(level)


def quiet_cluster_logs() -> dict:
    """Silence distributed's loggers in this process (an embedded cluster's scheduler and nannies
    warn about the tasks and workers a forced stop leaves behind); the stop is the one line.
    Returns each logger's level before, for :func:`graceful_stop` to put back."""
    names = [n for n in logging.root.manager.loggerDict if n.split(".")[0] == "distributed"]
    before = {}
    for name in dict.fromkeys(["distributed", *names]):
        logger = logging.getLogger(name)
        before[name] = logger.level
        logger.setLevel(logging.CRITICAL)
    return before


class _AbandonedGathers(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for distributed's ``AllExit``: a
    gather stops its per-key waits with it and means it to be quiet; a gather a forced stop
    abandons leaves them unretrieved, and each would be a traceback when collected."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (type(exc).__name__ == "AllExit"
                    and type(exc).__module__.startswith("distributed"))


def quiet_abandoned_gathers() -> None:
    """Install :class:`_AbandonedGathers` on the asyncio logger, once, for good: the waits are
    collected after the run's block has ended, at the latest when the interpreter exits."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedGathers) for f in logger.filters):
        logger.addFilter(_AbandonedGathers())


@contextlib.contextmanager
def signals_ignored(signals=HANDLED) -> Iterator[None]:
    """Ignore ``signals`` for the block: processes started inside inherit the ignored disposition
    through ``exec`` (Python keeps an ignored SIGINT ignored at start-up). No-op off the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
