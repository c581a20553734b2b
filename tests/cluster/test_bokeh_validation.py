"""Bokeh's validation switch per thread (pipeline.cluster.bokeh_validation): the dashboard's
/status page builds while another thread's dashboard update runs, and two overlapping updates
leave validation on. Each check here failed before the switch was per thread."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from bokeh.core.property.validation import without_property_validation
from distributed.dashboard.components.scheduler import ClusterMemory
from distributed.scheduler import MemoryState

from pipeline.cluster import bokeh_validation


class _IdleScheduler:
    """What ``ClusterMemory`` reads: no workers, no memory."""
    workers: dict = {}
    memory = MemoryState(process=0, unmanaged_old=0, managed=0, spilled=0)


def _holding_validation_off(entered: threading.Event, leave: threading.Event) -> threading.Thread:
    """A thread inside a dashboard update (validation off) until ``leave`` is set."""
    @without_property_validation
    def update():
        entered.set()
        leave.wait(30)
    thread = threading.Thread(target=update, name="other-dashboard-update")
    thread.start()
    assert entered.wait(30)
    return thread


def test_status_page_builds_while_another_thread_updates_a_dashboard():
    """distributed's /status: ``ClusterMemory`` built, then updated (``status_doc``), while a
    thread of another scheduler is inside an update. Bokeh's global switch left its title a
    ``str`` and the update raised "'str' object has no attribute 'text'" (an HTTP 500)."""
    assert bokeh_validation.per_thread()
    entered, leave = threading.Event(), threading.Event()
    thread = _holding_validation_off(entered, leave)
    try:
        memory = ClusterMemory(_IdleScheduler())
        memory.update()
    finally:
        leave.set()
        thread.join()
    assert memory.root.title.text == "Bytes stored: 0 B"


def test_overlapping_updates_on_two_threads_leave_validation_on():
    """A saves True and turns it off, B saves False, A restores True, B restores False: with one
    global switch validation stayed off for the process, and every later /status failed."""
    from bokeh.core.property.bases import validation_on
    assert bokeh_validation.per_thread()
    a_in, a_out, b_in, b_out = (threading.Event() for _ in range(4))

    @without_property_validation
    def update(entered, leave):
        entered.set()
        leave.wait(30)
    a = threading.Thread(target=update, args=(a_in, a_out))
    b = threading.Thread(target=update, args=(b_in, b_out))
    a.start()
    assert a_in.wait(30)
    b.start()
    assert b_in.wait(30)
    a_out.set()
    a.join()
    b_out.set()
    b.join()
    assert validation_on()


def test_a_thread_still_turns_validation_off_for_itself():
    from bokeh.core.property import bases
    from bokeh.core.property.validation import validate
    assert bokeh_validation.per_thread() and bokeh_validation.per_thread()  # idempotent
    seen = []
    with validate(False):
        seen.append(bases.validation_on())
        with validate(True):
            seen.append(bases.validation_on())
        seen.append(bases.validation_on())
    seen.append(bases.validation_on())
    assert seen == [False, True, False, True]


# Two schedulers with dashboards in one fresh process: a LocalCluster of the user's whose open
# /status pages update every 100 ms, and our embedded cluster, whose /status is fetched while
# threads switch every microsecond. Before the fix 11 of 30 fetches were HTTP 500s (and
# validation was left off); with one scheduler, 0 of 30.
_TWO_DASHBOARDS = textwrap.dedent("""
    import sys, urllib.error, urllib.request
    import distributed
    from bokeh.core.property.bases import validation_on
    from pipeline.cluster import connection
    from pipeline.core.config import ClusterConfig

    def status(port):
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=60).status
        except urllib.error.HTTPError as e:
            return e.code

    if __name__ == "__main__":
        with distributed.LocalCluster(n_workers=1, processes=False,
                                      dashboard_address="127.0.0.1:0") as user:
            for _ in range(5):
                status(user.scheduler.http_server.port)
            with connection.connect(ClusterConfig(workers=1, threads_per_worker=1)) as client:
                port = client.cluster.scheduler.http_server.port
                sys.setswitchinterval(1e-6)
                codes = [status(port) for _ in range(30)]
                sys.setswitchinterval(0.005)
        print(sorted(set(codes)), validation_on())
""")


def test_two_dashboards_in_one_process_serve_status(tmp_path):
    script = tmp_path / "two_dashboards.py"
    script.write_text(_TWO_DASHBOARDS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "[200] True", out.stderr[-2000:]
