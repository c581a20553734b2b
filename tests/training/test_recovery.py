"""The cluster side of recovery: what a failed attempt leaves behind on a real scheduler."""
import time

import distributed
import pytest

from pipeline.training import recovery


def _slow(x):
    time.sleep(1.0)
    return x


@pytest.mark.cluster
def test_forget_keeps_every_other_key_of_the_client(dask_client):
    """Forgetting an attempt whose tasks hang off an intermediate key nobody holds (an apply-
    between rounds) leaves the run's other keys (the persisted dataset) where they are.
    ``client.cancel`` did not: the scheduler's cancel asserted on the unheld key, dropped the
    client's connection and forgot everything the client held."""
    data = dask_client.submit(lambda: 7, key="data-block", pure=False)
    assert data.result(timeout=30) == 7
    first = dask_client.submit(_slow, 1, key="train-a", pure=False)
    middle = dask_client.submit(_slow, first, key="apply-a", pure=False)
    last = dask_client.submit(_slow, middle, key="train-b", pure=False)
    del middle  # held only through its dependent, as the driver holds an apply- chain
    recovery.forget([first, last], None)
    del first, last
    after = dask_client.submit(lambda v: v + 1, data, key="after", pure=False)
    assert after.result(timeout=30) == 8
    assert not data.cancelled() and dask_client.status == "running"


def test_forget_clears_the_frames_that_hold_futures():
    """The traceback's frames lose their locals (futures of the failed attempt)."""
    def fail(held):
        raise RuntimeError("lost")
    try:
        fail(["a future"])
    except RuntimeError as exc:
        error = exc
    recovery.forget([], error)
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_locals == {}


def test_scheduler_alive_waits_for_a_reconnecting_client():
    """A client whose connection dropped reconnects: it is not taken for a lost scheduler."""
    class Reconnecting:
        status = "connecting"
        pings = 0

        class scheduler:
            @staticmethod
            def identity():
                return {}

        def sync(self, func, callback_timeout):
            self.pings += 1
            return func()

    client = Reconnecting()
    distributed_loop = __import__("threading").Timer(0.3, lambda: setattr(client, "status",
                                                                           "running"))
    distributed_loop.start()
    assert recovery.scheduler_alive(client, timeout=5.0)
    assert client.pings == 1
    client.status = "closed"
    assert not recovery.scheduler_alive(client, timeout=5.0)


def test_a_worker_lost_twice_in_one_round_blames_the_users_model_only():
    """Lost work in the same round after one replay, with the user's model running: the
    model's own death (UsageError, exit 2); another round, or no one's code to blame (our
    model, no worker gone): replayed as before."""
    from pipeline.core.errors import UsageError
    alive, kinds = recovery.ClusterState(True), (OSError,)
    suspect = "model nets:Net's train task"
    first = recovery.decide(OSError(), alive, 0, where="", stopped_in=4, kinds=kinds,
                            suspect=suspect, lost_before=None)
    assert first == recovery.Replay(1)
    again = recovery.decide(OSError(), alive, 1, where="; hint", stopped_in=4, kinds=kinds,
                            suspect=suspect, lost_before=4)
    assert isinstance(again.error, UsageError)
    assert str(again.error).startswith("worker died inside model nets:Net's train task, "
                                       "round 4") and str(again.error).endswith("; hint")
    for suspect_, before in ((suspect, 3), (None, 4)):
        assert recovery.decide(OSError(), alive, 1, where="", stopped_in=4, kinds=kinds,
                               suspect=suspect_, lost_before=before) == recovery.Replay(2)
