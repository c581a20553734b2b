"""The embedded cluster's worker preload: a worker that closes while its heartbeat waits for the
scheduler's reply logs no traceback (distributed reports that race at ERROR); a running worker's
heartbeat failure is still reported."""
from __future__ import annotations

import asyncio
import logging
import threading

import distributed
import pytest

from pipeline.cluster.worker_setup import HEARTBEAT_FAILED, ClosingHeartbeatFilter, dask_setup


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def worker_log():
    log = logging.getLogger("distributed.worker")
    records, filters = _Records(), list(log.filters)
    log.addHandler(records)
    yield records
    log.removeHandler(records)
    log.filters[:] = filters


def _close_during_heartbeat(quiet: bool) -> None:
    """A thread-based cluster whose scheduler holds every heartbeat; closed while one waits."""
    waiting = threading.Event()
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as c, distributed.Client(c) as client:
        reply = c.scheduler.handlers["heartbeat_worker"]

        async def held(*args, **kwargs):
            waiting.set()
            await asyncio.sleep(30)
            return reply(*args, **kwargs)

        c.scheduler.handlers["heartbeat_worker"] = held
        if quiet:
            for worker in c.workers.values():
                dask_setup(worker)
        assert client.submit(sum, [1, 2]).result(timeout=10) == 3
        assert waiting.wait(10)


def _failures(records: _Records) -> list[str]:
    return [m for m in records.messages if m.startswith(HEARTBEAT_FAILED)]


def test_closing_during_a_heartbeat_is_reported_by_distributed_without_the_preload(worker_log):
    _close_during_heartbeat(quiet=False)  # the race this module exists for, made certain
    assert _failures(worker_log), worker_log.messages


def test_closing_during_a_heartbeat_is_quiet_with_the_preload(worker_log):
    _close_during_heartbeat(quiet=True)
    assert not _failures(worker_log), worker_log.messages


def test_running_workers_heartbeat_failure_is_kept_and_setup_is_idempotent(worker_log):
    class Worker:
        status = distributed.core.Status.running

    first, second = Worker(), Worker()
    dask_setup(first)
    dask_setup(second)
    log = logging.getLogger("distributed.worker")
    assert sum(isinstance(f, ClosingHeartbeatFilter) for f in log.filters) == 1
    log.error(HEARTBEAT_FAILED + ".")
    log.error("Unrelated error.")
    second.status = distributed.core.Status.closing
    log.error(HEARTBEAT_FAILED + ".")
    log.error("Unrelated error.")
    assert worker_log.messages == [HEARTBEAT_FAILED + ".", "Unrelated error.", "Unrelated error."]


def _raise(error):
    raise error


@pytest.mark.timeout(60)
def test_a_task_failing_with_our_one_line_error_logs_no_compute_failed(worker_log):
    """A data error found by a decode- task mid-run: the driver prints it as one line; the
    worker logs no "Compute Failed" with a traceback before it. A bug still does."""
    from pipeline.core.errors import DataError
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as c, distributed.Client(c) as client:
        for worker in c.workers.values():
            dask_setup(worker)
        for error in (DataError("x.jpg: corrupt or truncated image"), KeyError("bug")):
            with pytest.raises(type(error)):
                client.submit(_raise, error, pure=False).result(timeout=10)
    failed = [m for m in worker_log.messages if m.startswith("Compute Failed")]
    assert len(failed) == 1 and "KeyError" in failed[0], failed
