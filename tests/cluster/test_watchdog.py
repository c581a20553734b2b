"""The stalled-task watchdog (hardening class 7): a task running far longer than its peers is
reported, and past a limit its worker is retired so the work is replayed elsewhere, unchanged.

The decision is pure (``watchdog.judge``) and tested as such; one test stops a real worker
process with SIGSTOP mid-round, which distributed alone would wait out for 5 to 10 minutes.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pipeline import Config
from pipeline.cluster import watchdog
from pipeline.training.loop import train
from pipeline.cluster.watchdog import Running, judge, thresholds
from tests.clusters import subprocess_cluster
from tests.helpers import assert_same_bits


def _task(seconds: float, key="('train-ab', 3, 1)", stage="train", worker="tcp://w1"):
    return Running(key, stage, worker, seconds)


def test_thresholds_scale_with_the_peers_and_never_drop_below_the_floor():
    assert thresholds(None, 5, 20, 60) == (60, 240)  # no finished peer yet: the floor
    assert thresholds(1.0, 5, 20, 60) == (60, 240)
    assert thresholds(100.0, 5, 20, 60) == (500, 2000)
    assert thresholds(100.0, 5, 0, 60) == (500, None)  # retiring turned off


def test_judge_reports_once_then_retires_once():
    medians = {"train": 2.0}
    reported, retired = set(), set()
    assert judge([_task(30)], medians, 5, 20, 60, reported, retired) == []
    first = judge([_task(61)], medians, 5, 20, 60, reported, retired)
    assert [v.action for v in first] == ["report"]
    reported.add(first[0].task.key)
    assert judge([_task(200)], medians, 5, 20, 60, reported, retired) == []  # said already
    last = judge([_task(241)], medians, 5, 20, 60, reported, retired)
    assert [v.action for v in last] == ["retire"] and last[0].limit == 240
    retired.add("tcp://w1")
    assert judge([_task(500)], medians, 5, 20, 60, reported, retired) == []


def test_judge_compares_each_task_with_its_own_stage():
    medians = {"train": 100.0, "augment": 0.5}
    verdicts = judge([_task(300, stage="train"),
                      _task(300, key="('augment-ab', 3, 1)", stage="augment", worker="tcp://w2")],
                     medians, 5, 20, 60, set(), set())
    assert [(v.action, v.task.stage) for v in verdicts] == [("retire", "augment")]


def test_the_scheduler_side_functions_pickle_by_reference_and_read_a_scheduler(dask_client):
    assert dask_client.run_on_scheduler(watchdog.executing, "-nothing") == []


def test_a_silent_worker_is_judged_by_what_it_runs_queues_or_holds():
    """A stopped worker holding a result the driver gathers has no task running anywhere; the
    watchdog still sees it, by its silence (no heartbeat), through the keys it holds."""
    from types import SimpleNamespace as NS
    now = time.time()

    class Task(NS):
        __hash__ = object.__hash__

    def task(*key):
        return Task(key=key)

    silent = NS(address="tcp://w1", last_seen=now - 30, executing={}, processing=set(),
                has_what={task("train-abc", 3, 1): None, task("load-other", 0): None}.keys())
    alive = NS(address="tcp://w2", last_seen=now, executing={}, processing=set(),
               has_what={task("train-abc", 3, 0): None}.keys())
    rows = watchdog.executing("-abc", dask_scheduler=NS(workers={"a": silent, "b": alive}))
    assert [(r[0], r[1], r[2]) for r in rows] == [("('train-abc', 3, 1)", "train", "tcp://w1")]
    assert rows[0][3] >= 30


def _stop_when_busy(cluster, client, stopped: list, timeout: float = 30.0) -> None:
    """SIGSTOP the first worker (its nanny too) seen given a train- task or holding a train-
    result (the driver will gather from it); append ``(index, key)``. Train tasks here take a few
    ms: waiting for one to be running could let the run end first. Any worker will do: the
    scheduler may keep every train- task on one of them for rounds (CI once saw worker 1 get
    none in seven rounds while this waited for it)."""
    index_of = {addr: int(info["name"].rsplit("-", 1)[1]) for addr, info in
                client.scheduler_info(n_workers=-1)["workers"].items()}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        processing, held = client.processing(), client.has_what()
        for addr, index in index_of.items():
            keys = [*processing.get(addr, ()), *held.get(addr, ())]
            busy = [k for k in keys if isinstance(k, tuple) and k[0].startswith("train-")]
            if busy:
                os.killpg(cluster.workers[index].pid, signal.SIGSTOP)
                stopped.append((index, str(busy[0])))
                return
        time.sleep(0.005)


def _tee(log):
    def say(line):
        print(line, flush=True)
        log.append(line)
    return say


@pytest.mark.cluster
@pytest.mark.slow
def test_a_stopped_worker_is_retired_and_the_result_is_unchanged(dask_client):
    cfg = Config().replace(**{
        "data.source": "synthetic:256:64", "model.name": "small-cnn", "train.strategy": "ipm",
        "train.replicas": 3, "train.batch_size": 8, "average.mix_every": "1",
        "train.epochs": 1, "train.lr": 0.02, "seed": 5, "progress": False,
        "checkpoint_every": 4, "cluster.connect_timeout": 10.0,
        "cluster.stall_report": 2.0, "cluster.stall_retire": 4.0, "cluster.stall_min_s": 3.0})
    reference = train(cfg, client=dask_client).params
    import distributed
    log, stopped = [], []
    with subprocess_cluster(2, resources={"CPU": 1}) as cluster:
        try:
            with distributed.Client(cluster.address, set_as_default=False) as spy:
                def on_round(line):
                    if line["round"] == 3:
                        threading.Thread(target=_stop_when_busy, daemon=True,
                                         args=(cluster, spy, stopped)).start()
                start = time.monotonic()
                result = train(cfg.replace(**{"cluster.scheduler": cluster.address}),
                               log=_tee(log), on_round=on_round)
                took = time.monotonic() - start
        finally:
            for index, _ in stopped:  # stopped: SIGTERM would wait
                os.killpg(cluster.workers[index].pid, signal.SIGKILL)
    assert stopped, log
    assert any(x.startswith("stalled? ") for x in log), log
    retired = [x for x in log if x.startswith("stalled: ")]
    assert len(retired) == 1 and "retiring worker" in retired[0], log
    assert took < 60, (took, log)  # distributed alone: worker-ttl, 5 to 10 minutes
    assert_same_bits(reference, result.params, log)


def test_a_task_no_worker_may_run_ends_the_attempt_as_lost_work(dask_client):
    """A train- task held to the rank of a worker that is gone (here: a rank no worker ever
    had) waits in distributed's "no-worker" state for good; past max(stall_min_s,
    connect_timeout) the watchdog ends the attempt with NoWorker, which recovery replays."""
    from pipeline.training import recovery
    from pipeline.core.config import ClusterConfig
    held = dask_client.submit(sum, [1, 2], key=("train-nowork", 0, 1), pure=False,
                              resources={"CPU": 1, "RANK-9": 1})
    free = dask_client.submit(sum, [3, 4], key=("train-nowork", 0, 0), pure=False)
    log = []
    dog = watchdog.Watchdog(dask_client, ClusterConfig(stall_min_s=0.5, connect_timeout=0.5),
                            log.append, poll_s=0.2)
    start = time.monotonic()
    with pytest.raises(watchdog.NoWorker, match=r"\('train-nowork', 0, 1\) has waited \d+ s for "
                                                r"a worker offering CPU=1 RANK-9=1; no connected "
                                                r"worker does"):
        dog.wait([held, free], "-nowork")
    assert 0.5 < time.monotonic() - start < 10
    assert free.result(timeout=10) == 7
    decision = recovery.decide(watchdog.NoWorker("x"), recovery.ClusterState(True), 0, where="",
                               stopped_in=0)
    assert decision == recovery.Replay(1)
    # Another run's unrunnable task is not this run's business.
    assert dask_client.run_on_scheduler(watchdog.unrunnable, "-other") == []
    assert len(dask_client.run_on_scheduler(watchdog.unrunnable, "-nowork")) == 1
    held.cancel()


@pytest.mark.cluster
@pytest.mark.slow
def test_a_result_held_by_a_stopped_worker_is_gathered_from_its_recomputation():
    """The driver's gather of a finished result the worker then stopped holding (SIGSTOP after
    the task ended): distributed's own gather would wait on the silent worker's socket for good
    (no read timeout; its kernel still accepts). The watchdog looks while the gather runs,
    retires the silent worker, and the result is computed again on the other."""
    import distributed
    from pipeline.core.config import ClusterConfig
    with subprocess_cluster(2) as cluster:
        stopped = []
        try:
            with distributed.Client(cluster.address, set_as_default=False) as client:
                info = client.scheduler_info(n_workers=-1)["workers"]
                holder = sorted(info)[0]
                done = client.submit(sum, [1, 2], key=("train-held", 0, 0), workers=[holder],
                                     allow_other_workers=True)
                assert done.result(timeout=30) == 3
                index = int(info[holder]["name"].rsplit("-", 1)[1])
                os.killpg(cluster.workers[index].pid, signal.SIGSTOP)
                stopped.append(index)
                log = []
                dog = watchdog.Watchdog(client, ClusterConfig(stall_min_s=1.0, stall_report=2.0,
                                                              stall_retire=4.0), log.append,
                                        poll_s=0.2)
                got = []
                gathering = threading.Thread(target=lambda: got.append(dog.gather([done],
                                                                                  "-held")),
                                             daemon=True)
                start = time.monotonic()
                gathering.start()
                gathering.join(timeout=60)
                took = time.monotonic() - start
                assert got == [[3]], (took, log)
                assert any(x.startswith("stalled: ") and holder in x for x in log), log
        finally:
            for index in stopped:
                os.killpg(cluster.workers[index].pid, signal.SIGKILL)


def test_a_dropped_fetch_leaves_no_traceback_behind(dask_client, caplog):
    """Stall chaos (workers stopped and continued again and again): once a look retires a
    worker, ``Watchdog.gather`` drops the fetch in flight. distributed's ``_gather`` waits
    through helper tasks (``wait(k)``) it does not cancel with itself; when the future they
    watch then errs they raise ``AllExit`` to nobody, and asyncio printed "Task exception was
    never retrieved" with a traceback at the end of a run that succeeded."""
    import gc
    from pipeline.core.config import ClusterConfig
    from distributed.client import FutureCancelledError
    never = dask_client.submit(sum, [1], key=("train-chaos", 0, 0), pure=False,
                               resources={"NOWHERE": 1})  # waits, holding no thread
    dog = watchdog.Watchdog(dask_client, ClusterConfig(), lambda line: None, poll_s=0.2)
    looks = []

    def look(suffix):  # the first look retires a worker: the fetch in flight is dropped
        looks.append(suffix)
        if len(looks) == 2:
            never.cancel()
        return [watchdog.Verdict("retire", _task(9), None, 1.0)] if len(looks) == 1 else []
    dog.check = look
    caplog.set_level("ERROR", logger="asyncio")
    with pytest.raises((FutureCancelledError, Exception)):
        dog.gather([never], "-chaos")
    time.sleep(0.3)  # the orphan raises on the client's loop
    dask_client.sync(_collect_garbage)
    gc.collect()
    assert len(looks) >= 2
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()
                or "AllExit" in str(r.exc_info)], caplog.text


async def _collect_garbage():
    import gc
    gc.collect()
