"""Reading the scheduler's task stream during a run: the records the stage clock
(``pipeline.training.telemetry``) accounts, each once."""
from __future__ import annotations

import contextlib

import distributed


@contextlib.contextmanager
def reader(client: distributed.Client):
    """Yields a function returning the task-stream records not returned before (stage timing).

    Records are read by their place in the scheduler plugin's append count (the cursor
    distributed's own ``get_task_stream`` context manager uses), not by a time window: the
    plugin bisects a window over records kept in the order they finished, whose workers' stop
    times are not in order, so a window could leave a record out. A scheduler without the
    cursor (distributed before it) is read by windows overlapping by a second. Records are
    de-duplicated either way. The first call registers the plugin, so it is made on entry.
    """
    cursor = _cursor(client)
    seen: set = set()
    if cursor is None:
        import time
        client.get_task_stream(start=time.time(), stop=time.time())
        mark = [time.time() - 1.0]

        def read():
            now = time.time()
            records = client.get_task_stream(start=mark[0] - 1.0, stop=now + 1.0)
            mark[0] = now
            return records
    else:
        def read():
            # the count before the read: what is appended between the two comes again next time
            # (de-duplicated), and a buffer that overflowed leaves the cursor at its true place
            now = client.sync(client.scheduler.get_task_stream_index)
            records = client.sync(client.scheduler.get_task_stream, start_index=cursor[0])
            cursor[0] = int(now)
            return records

    def since_last():
        fresh = []
        for rec in read():
            ident = (str(rec.get("key")), tuple(ss.get("start") for ss in rec.get("startstops", ())))
            if ident not in seen:
                seen.add(ident)
                fresh.append(rec)
        return fresh

    yield since_last


def _cursor(client: distributed.Client) -> list | None:
    """[the task stream's append count now] (registering the plugin), or None where the
    scheduler has no such handler (it logs "No handler" and answers None)."""
    try:
        index = client.sync(client.scheduler.get_task_stream_index)
    except Exception:  # noqa: BLE001  whatever an older scheduler answers: read by windows
        index = None
    return None if index is None else [int(index)]
