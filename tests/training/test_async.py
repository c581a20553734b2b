"""Asynchronous updates: the order of application as a pure value, determinism, replay, resume."""
import json

import numpy as np
import pytest

from pipeline import Config
from pipeline.core.errors import UsageError
from pipeline.training.strategies.asynchronous import InFlight, allowed, apply, fixed_order, read_order
from pipeline.training.loop import train
from tests.resuming import whole_and_resumed
from tests.helpers import assert_same_bits, make_config

SMALL = "synthetic:512:128"


BASE = {"data.source": SMALL, "model.name": "small-cnn", "train.batch_size": 16,
        "train.epochs": 1, "train.lr": 0.02, "augment.policy": "cifar", "progress": False,
        "checkpoint_every": 0, "seed": 4, "train.strategy": "async", "train.replicas": 3,
        "average.mix_every": "2"}


def _config(**changes) -> Config:
    return make_config(BASE, **changes)


def _updates(out) -> list[dict]:
    return [json.loads(x) for x in (out / "updates.jsonl").read_text().splitlines()]


def test_apply_adds_the_scaled_delta_in_float64():
    server = {"W": np.float32([1.0, 2.0]), "N": np.int64(3)}
    pulled = {"W": np.float32([0.0, 0.0]), "N": np.int64(1)}
    pushed = {"W": np.float32([0.3, -0.6]), "N": np.int64(2)}
    out = apply(server, pulled, pushed, 1 / 3)
    expect = (np.float64([1.0, 2.0]) + (np.float64([0.3, -0.6]) - 0) / 3).astype(np.float32)
    assert out["W"].tobytes() == expect.tobytes() and out["N"] == 4


def test_staleness_bound_holds_back_a_fast_replica():
    # replica 1 pulled at version 1 and is still out; at position 3 a bound of 2 lets replica 1
    # (2 behind) go but not replica 0 (its apply would leave replica 1 three behind).
    inflight = {0: InFlight(4, 3), 1: InFlight(2, 1)}
    assert not allowed(3, 0, inflight, 2) and allowed(3, 1, inflight, 2)
    assert allowed(3, 0, inflight, 3) and allowed(3, 0, inflight, None)


def test_fixed_order_is_round_robin():
    assert fixed_order(2, 5) == [0, 1, 0, 1, 0]


@pytest.mark.parametrize("text, message", [
    ('{"position": 0, "replica": 0}\n', "holds 1 updates, the run applies 2"),
    ('{"position": 0, "replica": 5}\n{"position": 1, "replica": 0}\n', "names replica 5"),
    ('{"position": 0, "replica": 0}\nnot json\n', "line 2 is not an update record"),
])
def test_bad_replay_files_are_one_line_usage_errors(tmp_path, text, message):
    path = tmp_path / "updates.jsonl"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        read_order(str(path), 2, 2)
    with pytest.raises(UsageError, match="cannot read"):
        read_order(str(tmp_path / "missing.jsonl"), 2, 2)


def test_max_staleness_below_k_minus_1_is_refused(dask_client):
    with pytest.raises(UsageError, match="asynchronous.max_staleness must be >= replicas - 1"):
        train(_config(**{"asynchronous.max_staleness": 1}), client=dask_client)


def test_replay_reproduces_an_arrival_run_byte_for_byte(tmp_path, dask_client):
    arrival = train(_config(out=str(tmp_path / "arrival")), client=dask_client)
    log = _updates(tmp_path / "arrival")
    assert [x["position"] for x in log] == list(range(len(arrival.history) * 3))
    assert all(x["staleness"] <= 2 * 3 for x in log)
    replay = train(_config(**{"asynchronous.replay_updates": str(tmp_path / "arrival" /
                                                                  "updates.jsonl")}),
                   client=dask_client)
    assert_same_bits(arrival.params, replay.params)
    assert [h["train_loss"] for h in arrival.history] == [h["train_loss"] for h in replay.history]
    line = arrival.history[-1]
    assert {"staleness_mean", "staleness_max", "updates_by_replica"} <= set(line)
    assert line["stage_seconds"]["apply"] > 0 and "average" not in line["stage_seconds"]


def test_fixed_resume_equals_uninterrupted(tmp_path, dask_client):
    cfg = _config(**{"asynchronous.order": "fixed", "checkpoint_every": 2, "train.epochs": 2})
    whole, resumed = whole_and_resumed(cfg, tmp_path, dask_client)
    assert_same_bits(whole.params, resumed.params)
    assert _updates(tmp_path / "cut") == _updates(tmp_path / "whole")


@pytest.mark.slow
def test_fixed_order_identical_on_1_and_3_worker_processes():
    cfg = _config(**{"asynchronous.order": "fixed", "cluster.threads_per_worker": 1,
                     "asynchronous.max_staleness": 4})
    one = train(cfg.replace(**{"cluster.workers": 1}))
    three = train(cfg.replace(**{"cluster.workers": 3}))
    assert_same_bits(one.params, three.params)


# --- hostile input, round three: an update log is read as any user file -------------------------

_OK = '{"position": 0, "replica": 0}\n'


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text, message", [
    (_OK + '{"position": Infinity, "replica": 1}\n', "line 2 is not an update record"),
    (_OK + '{"position": 1e400, "replica": 1}\n', "line 2 is not an update record"),
    (_OK + '{"position": 1.0, "replica": 1}\n', "line 2 is not an update record"),
    (_OK + '{"position": 1, "replica": true}\n', "line 2 is not an update record"),
    (_OK + "[" * 100_000 + "]" * 100_000 + "\n", "line 2 is not an update record"),
    (_OK + '{"position": 0, "replica": 1}\n', "line 2 names position 0 again"),
    (_OK + '{"position": -1, "replica": 1}\n', "line 2 names position -1"),
    (_OK + '{"position": 1, "replica": 0}\n{"position": 2, "replica": 0}\n'
     '{"position": 3, "replica": 0}\n',
     "position 3 names replica 0, which has no update left to apply then"),
    ('{"position": 0, "replica": 0}\u2028{"position": 1, "replica": 1}\n',
     "line 1 is not an update record"),  # split on newlines only
])
def test_hostile_replay_files_are_one_line_usage_errors(tmp_path, text, message):
    path = tmp_path / "updates.jsonl"
    path.write_text(text)
    updates = 4 if "replica 0, which" in message else 2
    with pytest.raises(UsageError, match=message):
        read_order(str(path), 2, updates)


@pytest.mark.timeout(30)
def test_a_fifo_device_or_huge_replay_file_is_refused_without_reading_it(tmp_path):
    import os
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: an open that blocked would wait forever
    with pytest.raises(UsageError, match=r"fifo: is a FIFO \(named pipe\), expected a regular"):
        read_order(str(fifo), 2, 2)
    with pytest.raises(UsageError, match=r"/dev/zero: is a character device"):
        read_order("/dev/zero", 2, 2)
    sparse = tmp_path / "sparse.jsonl"
    with open(sparse, "wb") as f:
        f.truncate(1 << 40)  # 1 TiB of holes
    with pytest.raises(UsageError, match=r"1099511627776 bytes is more than an update log of 2 "
                                         r"updates can hold \(at most 1050624 bytes\)"):
        read_order(str(sparse), 2, 2)
