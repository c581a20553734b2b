"""What the embedded cluster's worker processes run as they start (a Dask preload module).

One thing so far: a closing worker's heartbeat failure is not reported. `Worker.close` closes its
connection pool while a heartbeat to the scheduler may still be waiting for the reply; that read
then fails with "Stream is closed" and distributed logs it at ERROR with a traceback
(dask/distributed#5371; NVIDIA-NeMo/Curator#9 "Fix noisy Dask shutdown"). On every Ctrl-C or end
of a run that would print a traceback under the driver's last line. A heartbeat failure of a
running worker is still reported.

And a task that fails with one of our own one-line errors (a ``DataError`` found while decoding
an image mid-run) is not logged as distributed's "Compute Failed" with its task and traceback:
the driver prints that error as its one line, and the worker's 29 lines before it were noise.
Any other exception in a task is still logged.

And the comm's failed guess at a message's size is not reported: before sending a message a
worker sizes it with `safe_sizeof(msg, default_size=-1)`, only to choose whether to serialize it on
a thread. The worker profile that `distributed.performance_report` asks for is a dict nested as
deep as the stacks sampled (Chainer's forward and backward inside a task), and dask's recursive
`sizeof` of it exceeds Python's recursion limit; distributed then logs "Sizeof calculation for
object of type 'dict' failed. Defaulting to -1 B" and sends the message as usual
(dask/distributed#8578). The report is complete; unfiltered, each worker prints that line
(into notebook 03, once per worker).
A failed sizeof with any other default (a task's result: 0.95 MiB) is still logged.
"""
from __future__ import annotations

import logging
import weakref

HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat"
_CLOSING = frozenset({"closing", "closing_gracefully", "closed"})


class ClosingHeartbeatFilter(logging.Filter):
    """Drops the heartbeat-failure record while a worker of this process is closing.

    A worker process holds one worker; in one process with several (a thread-based cluster) the
    record cannot tell which worker logged it, so any closing one drops it.

    >>> class W: status = "running"
    >>> w = W(); f = ClosingHeartbeatFilter(); f.watch(w)
    >>> record = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 0,
    ...                            HEARTBEAT_FAILED + ".", None, None)
    >>> f.filter(record)
    True
    >>> w.status = "closing"
    >>> f.filter(record)
    False
    """

    def __init__(self) -> None:
        super().__init__()
        self._workers: weakref.WeakSet = weakref.WeakSet()

    def watch(self, worker) -> None:
        self._workers.add(worker)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(HEARTBEAT_FAILED):
            return True
        return not any(_status_name(w) in _CLOSING for w in list(self._workers))


COMPUTE_FAILED = "Compute Failed"
# The one-line errors of pipeline.core.errors, as the repr distributed logs them by (``repr(exc)``)
OWN_ERRORS = ("UsageError(", "DataError(", "ClusterError(", "ResumeError(", "OutputError(")


class OwnErrorFilter(logging.Filter):
    """Drops distributed's "Compute Failed" record of a task that raised one of our one-line
    errors (the driver reports it); keeps every other record.

    >>> record = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 0,
    ...     COMPUTE_FAILED + "\\nKey: %s\\nState: %s\\nTask: %s\\nException: %r\\nTraceback: %r\\n",
    ...     ("k", "executing", "t", "DataError('x.jpg: corrupt')", "tb"), None)
    >>> OwnErrorFilter().filter(record)
    False
    >>> record.args = ("k", "executing", "t", "KeyError('bug')", "tb")
    >>> OwnErrorFilter().filter(record)
    True
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(COMPUTE_FAILED):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        exception = args[3] if len(args) > 3 else ""
        return not (isinstance(exception, str) and exception.startswith(OWN_ERRORS))


SIZEOF_FAILED = "Sizeof calculation for object of type"
MESSAGE_DEFAULT = "Defaulting to -1 B"  # the default of comm.utils.to_frames, and only there


class MessageSizeofFilter(logging.Filter):
    """Drops distributed.sizeof's warning about a comm message it could not size (harmless: the
    size only decides whether serialization moves to a thread); keeps the one about task results.

    >>> msg = ("Sizeof calculation for object of type 'dict' failed. Defaulting to -1 B",)
    >>> record = logging.LogRecord("distributed.sizeof", logging.WARNING, __file__, 0, msg, None,
    ...                            None)
    >>> MessageSizeofFilter().filter(record)
    False
    >>> record.msg = ("Sizeof calculation for object of type 'Net' failed. Defaulting to 0.95 MiB",)
    >>> MessageSizeofFilter().filter(record)
    True
    """

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)  # distributed passes a 1-tuple as the message
        return not (SIZEOF_FAILED in text and MESSAGE_DEFAULT in text)


def _status_name(worker) -> str:
    status = getattr(worker, "status", "")
    return getattr(status, "name", status)


def dask_setup(worker) -> None:
    """Dask calls this in each worker process that names this module in its `preload`."""
    log = logging.getLogger("distributed.worker")
    found = [f for f in log.filters if isinstance(f, ClosingHeartbeatFilter)]
    if found:
        found[0].watch(worker)
        return
    quiet = ClosingHeartbeatFilter()
    quiet.watch(worker)
    log.addFilter(quiet)
    log.addFilter(OwnErrorFilter())
    logging.getLogger("distributed.sizeof").addFilter(MessageSizeofFilter())
