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
    """A second signal: stop now, without waiting for the round boundary."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_status = 128 + int(signum)


@contextlib.contextmanager
def graceful_stop(signals=HANDLED) -> Iterator[StopRequest]:
    """Install handlers for ``signals`` for the block; yield the :class:`StopRequest` they set.

    The first signal only sets the request; the next raises :class:`ForcedStop` in the main thread.
    Outside the main thread (where Python cannot install handlers) the request is returned unarmed.
    """
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.requested:
            quiet_cluster_logs()  # the cluster closes mid-task: its warnings are not news
            raise ForcedStop(signum)
        stop.request(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def quiet_cluster_logs() -> None:
    """Silence distributed's loggers in this process (an embedded cluster's scheduler and nannies
    warn about the tasks and workers a forced stop leaves behind); the stop is the one line."""
    import logging
    names = [n for n in logging.root.manager.loggerDict if n.split(".")[0] == "distributed"]
    for name in ["distributed", *names]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


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
