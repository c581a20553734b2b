"""The seams: import layering, keys, the recovery decision, stage accounting, the registries."""
import pickle
import subprocess
import sys

import pytest

from pipeline import keys, recovery, strategies
from pipeline.config import STRATEGIES
from pipeline.errors import ClusterError
from pipeline.telemetry import StageClock
from tests.pipeline.clusters import REPO

# Modules that must import neither dask nor a framework (pure array code, plans, decisions).
PURE = ["augment", "pipeline.keys", "pipeline.schedule", "pipeline.averaging", "pipeline.rng",
        "pipeline.config", "pipeline.checkpoint", "pipeline.scaling", "pipeline.backend",
        "pipeline.tasks", "pipeline.telemetry", "pipeline.recovery", "pipeline.outputs",
        "pipeline.threads", "pipeline.strategies", "pipeline.strategies.base",
        "pipeline.strategies.single", "pipeline.strategies.gradient",
        "pipeline.strategies.mixture", "pipeline.strategies.ipm",
        "pipeline.strategies.asynchronous", "pipeline.files", "pipeline.npz", "pipeline.rundir",
        "pipeline.resume", "pipeline.watchdog", "pipeline.reduce_order", "pipeline.shards",
        "pipeline.placement"]


def test_pure_modules_import_neither_dask_nor_chainer():
    code = ("import importlib, sys\n"
            f"for name in {PURE!r}:\n"
            "    importlib.import_module(name)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('dask', 'distributed', 'chainer'))\n"  # CuPy may load: augment.xp tries it
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "", out


def test_every_registered_strategy_loads_and_the_config_knows_it():
    assert STRATEGIES == strategies.NAMES
    for name in strategies.NAMES:
        assert strategies.get(name).name == name
    with pytest.raises(ValueError, match="train.strategy must be one of"):
        strategies.get("hogwild")


def test_keys_round_trip():
    key = keys.make("apply", "0123abcd", 5, 2)
    assert keys.stage_of(key) == keys.stage_of(str(key)) == "apply"
    assert keys.round_of(key) == keys.round_of(str(key)) == 5
    assert keys.stage_of(("images-0123abcd", 1, 0, 0, 0)) == "load"
    assert keys.round_of(("images-0123abcd", 1, 0, 0, 0)) is None
    with pytest.raises(ValueError, match="8 lowercase hex"):
        keys.make("train", "nothex!!", 0)


def test_stage_clock_charges_rounds_and_load():
    t = [100.0]
    clock = StageClock(load_seconds=2.0, first_round=0, clock=lambda: t[0])
    records = [{"key": ("train-0123abcd", 0, 1), "startstops": [
                   {"action": "compute", "start": 1.0, "stop": 3.0}]},
               {"key": "('images-0123abcd', 0, 0, 0, 0)", "startstops": [
                   {"action": "compute", "start": 0.0, "stop": 0.5}]},
               {"key": ("apply-0123abcd", 1, 0), "startstops": [
                   {"action": "compute", "start": 3.0, "stop": 3.25}]}]
    clock.account(records, collecting=0)
    t[0] = 105.0
    zero = clock.stage_seconds(0, ("load", "train", "apply"))
    assert zero == {"load": 2.5, "train": 2.0, "apply": 0.0, "waiting": 2.5}
    assert clock.stage_seconds(1, ("train", "apply"))["apply"] == 0.25


LOST = (OSError,)


def test_recovery_replays_lost_work_then_gives_up():
    alive = recovery.ClusterState(True)
    decision, retries = None, 0
    for _ in range(3):
        decision = recovery.decide(OSError("worker gone"), alive, retries, where="; w",
                                   stopped_in=4, kinds=LOST)
        assert isinstance(decision, recovery.Replay)
        retries = decision.retries
    final = recovery.decide(OSError("worker gone"), alive, retries, where="; w", stopped_in=4,
                            kinds=LOST)
    assert isinstance(final, recovery.GiveUp) and isinstance(final.error, ClusterError)
    assert str(final.error) == ("gave up after losing work 4 times in a row, last in round 4 "
                                "(OSError: worker gone); w")


def test_recovery_never_replays_a_lost_scheduler_or_a_bug():
    dead = recovery.decide(OSError("x"), recovery.ClusterState(False), 0, where="; w",
                           stopped_in=2, scheduler="tcp://a:1", kinds=LOST)
    assert str(dead.error).startswith("lost the scheduler tcp://a:1 while waiting for round 2")
    bug = ZeroDivisionError("bug")
    assert recovery.decide(bug, recovery.ClusterState(True), 0, where="", stopped_in=0,
                           kinds=LOST).error is bug


def test_recovery_knows_distributed_losses():
    import distributed
    from distributed.client import FutureCancelledError
    assert issubclass(FutureCancelledError, recovery.lost_work_types())
    assert distributed.KilledWorker in recovery.lost_work_types()


def test_task_functions_pickle():
    from pipeline import augment_graph, tasks
    from pipeline.averaging_algorithms import base, tree
    from pipeline.strategies import asynchronous, ipm
    for fn in (tasks.train, tasks.update, tasks.evaluate, augment_graph.augment, ipm.average_outer,
               ipm.pack, tree._leaf, base.take_payload, base.local_sum, asynchronous.apply,
               asynchronous.apply_gradient):
        assert pickle.loads(pickle.dumps(fn)) is fn
