"""The stage clock's reader of the scheduler's task stream (``pipeline.training.task_stream``): every record
once, by the plugin's append count, whatever the workers' clocks say."""
from __future__ import annotations

import time

from pipeline.training import task_stream


def _skewed_record(dask_scheduler, key: str, behind_s: float) -> None:
    """Append a finished task's record as a worker whose clock is ``behind_s`` behind would."""
    plugin = dask_scheduler._task_stream_plugin()
    now = time.time() - behind_s
    plugin.transition(key, "processing", "memory", worker="tcp://10.0.0.9:1", thread=1,
                      startstops=({"action": "compute", "start": now - 0.2, "stop": now},))


def _keys(records) -> list:
    return sorted(str(rec["key"]) for rec in records)


def test_every_record_is_read_once_even_from_a_worker_whose_clock_is_behind(dask_client):
    with task_stream.reader(dask_client) as since_last:
        assert since_last() == []
        futures = dask_client.map(abs, [-1, -2, -3], key=["train-a", "train-b", "train-c"])
        dask_client.gather(futures)
        first = since_last()
        # reported after the first read, stamped two minutes before it
        dask_client.run_on_scheduler(_skewed_record, key="average-late", behind_s=120.0)
        futures = dask_client.map(abs, [-4, -5], key=["evaluate-a", "evaluate-b"])
        dask_client.gather(futures)
        second = since_last()
        assert since_last() == []
    assert _keys(first) == ["train-a", "train-b", "train-c"]
    assert _keys(second) == ["average-late", "evaluate-a", "evaluate-b"]


def test_a_scheduler_without_the_cursor_is_read_by_time_windows(dask_client):
    handlers = dask_client.cluster.scheduler.handlers
    handler = handlers.pop("get_task_stream_index")
    try:
        assert task_stream._cursor(dask_client) is None
        with task_stream.reader(dask_client) as since_last:
            futures = dask_client.map(abs, [-6, -7], key=["train-x", "train-y"])
            dask_client.gather(futures)
            # a window also holds what finished just before it opened: the two tasks at least
            assert {"train-x", "train-y"} <= set(_keys(since_last()))
            assert since_last() == []
    finally:
        handlers["get_task_stream_index"] = handler
