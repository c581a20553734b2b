"""Faults with real processes: lost workers, a killed driver, a lost scheduler, divergence, damaged
checkpoints, and a long run that must hand every key and byte back.

Every run here is compared byte for byte with one uninterrupted reference run of the same config:
replays and resumes recompute the same values because every random choice is keyed by the run
seed and the task's coordinates (docs/architecture.md, Determinism).
"""
from __future__ import annotations

import re

import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline import Config
from pipeline.outputs import fs
from pipeline.training import tasks
from pipeline.cli.parser import build_parser
from pipeline.cli.commands import config_from_args
from pipeline.core.errors import ClusterError, DivergenceError
from pipeline.training.loop import train
from tests.clusters import Killer, subprocess_cluster
from tests.clusters import train_cli as _cli
from tests.helpers import assert_same_bits, loaded_weights, wait_for_lines

# 256 images, K=3 replicas of batch 8: 10 steps per epoch; H=1: 20 rounds in 2 epochs. The CLI
# runs checkpoint every 10 rounds (the default: rounds 9 and 19), the in-process ones every 4
# (3, 7, 11, 15, 19). A round is ~0.1 s of work, so a fault lands while tasks run.
ARGS = ["--data", "synthetic:256:64", "--model", "small-cnn", "--strategy", "ipm",
        "--replicas", "3", "--batch-size", "8", "--mix-every", "1", "--epochs", "2",
        "--lr", "0.02", "--augment", "cifar", "--seed", "5", "--no-progress"]
ROUNDS, EVERY = 20, 4


def _config(out=None, **changes) -> Config:
    """The config ``python -m pipeline train ARGS --out OUT`` runs (one source for both), with
    a checkpoint every ``EVERY`` rounds unless ``changes`` say otherwise."""
    args = build_parser().parse_args(["train", *ARGS] + (["--out", str(out)] if out else []))
    return config_from_args(args).replace(**{"checkpoint_every": EVERY, **changes})


@pytest.fixture(scope="module")
def reference(dask_client):
    """The uninterrupted run's final weights (no output directory)."""
    return train(_config(), client=dask_client).params


def _metric_rounds(out: Path) -> list[int]:
    return [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def _on_cluster(cluster, out, **changes) -> Config:
    return _config(out, **{"cluster.scheduler": cluster.address,
                           "cluster.connect_timeout": 5.0, **changes})


def _train_with_kills(tmp_path, plan: dict[int, int], n_workers: int = 3):
    lines = []
    with subprocess_cluster(n_workers, resources={"CPU": 1}) as cluster:
        killer = Killer(cluster, plan)
        try:
            result = train(_on_cluster(cluster, tmp_path), log=lines.append, on_round=killer)
        finally:
            killer.close()
        assert [k[0] for k in killer.killed] == [plan[r] for r in sorted(plan)], (
            killer.killed, cluster.logs())
        alive = [w.poll() is None for w in cluster.workers]
    return result, killer.killed, lines, alive


@pytest.mark.cluster
def test_worker_killed_mid_round_finishes_with_identical_weights(tmp_path, reference):
    result, killed, log, alive = _train_with_kills(tmp_path, {5: 0})
    assert alive == [False, True, True]
    assert_same_bits(result.params, reference, (killed, log))
    assert_same_bits(loaded_weights(tmp_path), reference)
    assert _metric_rounds(tmp_path) == list(range(ROUNDS))  # replayed rounds reported once
    assert [x["round"] for x in result.history] == list(range(ROUNDS))
    assert len(_replays(log)) <= 1, log  # one replay at most (none if lineage sufficed)
    _assert_from_checkpoints(log)


def _assert_from_checkpoints(log: list[str]) -> None:
    """Each replay started after a checkpoint (or at 0), at most one checkpoint period back."""
    for start, lost in _replays(log):
        assert start % EVERY == 0 and lost - EVERY <= start <= lost, log


def _replays(log: list[str]) -> list[tuple[int, int]]:
    """(replayed from round, lost round) of each recovery the driver logged."""
    found = []
    for line in log:  # "worker w0 lost in round 12: replaying rounds 10-12 on 1 worker"
        match = re.search(r"in round (\d+)(?: \(.*\))?: replaying rounds? (\d+)", line)
        if match:
            found.append((int(match.group(2)), int(match.group(1))))
    return found


@pytest.mark.cluster
def test_a_dropped_client_connection_reloads_the_data_and_replays(tmp_path, reference):
    """The scheduler closes the driver's connection mid-run (its cancel bug did, see
    ``recovery.forget``) and forgets every key the client held, the persisted dataset too: the
    client reconnects, the run loads the data again, replays from its last checkpoint and ends
    with the uninterrupted run's weights."""
    import distributed
    lines = []
    with subprocess_cluster(2, resources={"CPU": 1}) as cluster, \
            distributed.Client(cluster.address, set_as_default=False) as client:
        def drop(line):
            if line["round"] == 5:
                client.loop.add_callback(client.scheduler_comm.comm.abort)
        result = train(_on_cluster(cluster, tmp_path), client=client, log=lines.append,
                       on_round=drop)
    assert any("forgot the dataset's blocks: loading them again" in x for x in lines), lines
    assert [x["round"] for x in result.history] == list(range(ROUNDS))
    assert_same_bits(result.params, reference, lines)


@pytest.mark.cluster
def test_two_workers_lost_one_after_the_other(tmp_path, reference):
    result, killed, log, alive = _train_with_kills(tmp_path, {2: 0, 9: 1})
    assert alive == [False, False, True], killed
    assert_same_bits(result.params, reference, (killed, log))
    assert _metric_rounds(tmp_path) == list(range(ROUNDS))
    _assert_from_checkpoints(log)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "round-000015", "round-000019"]


@pytest.mark.cluster
def test_all_workers_lost_stops_with_one_line(tmp_path):
    with subprocess_cluster(1, resources={"CPU": 1}) as cluster:
        killer = Killer(cluster, {5: 0})
        try:
            with pytest.raises(ClusterError) as err:
                train(_on_cluster(cluster, tmp_path), on_round=killer, log=lambda _: None)
        finally:
            killer.close()
    message = str(err.value)
    assert "\n" not in message and message.startswith("cannot replay from round ")
    assert "has 0 workers, needs 1 (waited 5 s)" in message
    last = int(message.split("the last checkpoint is round ")[1].split(":")[0])
    assert (tmp_path / "checkpoints" / f"round-{last:06d}").is_dir()
    assert message.endswith(f"resume with `python -m pipeline train --resume {tmp_path}`")


_KILLED_KEYS: list = []  # keys of the _always_killed tasks (in-process workers share it)


def _always_killed(params, opt, shard, spec):
    """A train task whose worker always dies (as the scheduler reports it after 3 deaths)."""
    import types

    import distributed
    key = distributed.get_worker().get_current_task()
    _KILLED_KEYS.append(key)
    raise distributed.KilledWorker(key, types.SimpleNamespace(address="tcp://gone:1"), 3)


def test_lost_work_again_and_again_gives_up_with_one_line(tmp_path, dask_client, monkeypatch):
    monkeypatch.setattr(tasks, "train", _always_killed)
    _KILLED_KEYS.clear()
    log = []
    with pytest.raises(ClusterError) as err:
        train(_config(tmp_path), client=dask_client, log=log.append)
    assert len([x for x in log if "replaying round 0 on " in x]) == 3, log
    assert all("KilledWorker" not in x and "Traceback" not in x for x in log), log
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith("gave up after losing work 4 times in a row, last in round 0 "
                              "(KilledWorker: ")
    assert message.endswith(f"no checkpoint yet: start again with --out {tmp_path} --overwrite")
    # The first attempt and every replay ran under a key token of their own.
    assert len({key[0] for key in _KILLED_KEYS}) == 4, _KILLED_KEYS


# --- the driver and the scheduler ---------------------------------------------------------------


def _finish(proc: subprocess.Popen, timeout: float = 120.0) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.cluster
def test_driver_killed_mid_run_resumes_to_identical_weights(tmp_path, reference):
    out = tmp_path / "run"
    with subprocess_cluster(2, resources={"CPU": 1}) as cluster:
        driver = _cli(*ARGS, "--scheduler", cluster.address, "--out", str(out))
        wait_for_lines(out / "metrics.jsonl", 12, driver)  # round 9 is checkpointed by now
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(10)
        assert driver.returncode == -signal.SIGKILL
        assert not (out / "model.npz").exists()
        resumed = _cli("--resume", str(out), "--scheduler", cluster.address, "--no-progress")
        code, stdout, stderr = _finish(resumed)
    assert code == 0, stderr
    assert "resuming" in stderr and stdout.startswith(f"done: {ROUNDS} rounds")
    assert_same_bits(loaded_weights(out), reference)
    assert _metric_rounds(out) == list(range(ROUNDS))
    assert not [p for p in out.rglob(".*") if p.name.endswith(".tmp")]  # no half-written files


@pytest.mark.cluster
def test_scheduler_lost_stops_with_one_line_and_resumes(tmp_path, reference):
    out = tmp_path / "run"
    with subprocess_cluster(2, resources={"CPU": 1}) as cluster:
        driver = _cli(*ARGS, "--scheduler", cluster.address, "--out", str(out))
        wait_for_lines(out / "metrics.jsonl", 12, driver)
        started = time.monotonic()
        os.killpg(cluster.scheduler.pid, signal.SIGKILL)
        code, stdout, stderr = _finish(driver, timeout=60)
        stopped = time.monotonic() - started
        for i in range(len(cluster.workers)):  # orphans: SIGTERM would wait for their nannies
            cluster.kill_worker(i)
    errors = [x for x in stderr.splitlines() if x.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith(f"error: lost the scheduler {cluster.address}"), errors
    last = int(errors[0].split("the last checkpoint is round ")[1].split(":")[0])
    assert f"resume with `python -m pipeline train --resume {out}`" in errors[0]
    assert last == 9 and (out / "checkpoints" / f"round-{last:06d}").is_dir()
    assert stopped < 20, stopped
    with subprocess_cluster(2, resources={"CPU": 1}) as fresh:
        code, stdout, stderr = _finish(_cli("--resume", str(out), "--scheduler", fresh.address))
    assert code == 0, stderr
    assert_same_bits(loaded_weights(out), reference)
    assert _metric_rounds(out) == list(range(ROUNDS))


# --- divergence and damaged checkpoints ---------------------------------------------------------

_real_train = tasks.train
SPIKE = (7, 1)  # (round, replica) whose learning rate spikes to infinity


def _spiking_train(params, opt, shard, spec):
    """tasks.train, but replica 1 of round 7 steps at lr inf (its weights go NaN/Inf)."""
    if (spec.round, spec.replica) == SPIKE:
        spec = spec._replace(lrs=(float("inf"),) * len(spec.lrs))
    return _real_train(params, opt, shard, spec)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_divergence_stops_and_keeps_the_last_good_checkpoint(tmp_path, dask_client, monkeypatch):
    monkeypatch.setattr(tasks, "train", _spiking_train)  # in-process workers see the module
    with pytest.raises(DivergenceError, match=r"round 7 \(epoch 0\), replica 1: .* NaN or Inf"):
        train(_config(tmp_path), client=dask_client)
    # Round 7 is a checkpoint round: its metrics are checked before anything is written.
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["round-000003"]
    assert _metric_rounds(tmp_path) == list(range(7))
    assert not (tmp_path / "model.npz").exists() and not (tmp_path / "summary.json").exists()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "truncated state.npz": lambda d: _truncate(d / "state.npz"),
    "truncated model.npz": lambda d: _truncate(d / "model.npz"),
    "truncated meta.json": lambda d: _truncate(d / "meta.json"),
    "meta.json missing": lambda d: (d / "meta.json").unlink(),
}


@pytest.fixture(scope="module")
def interrupted(dask_client, tmp_path_factory) -> Path:
    """An output directory whose run stopped after round 12: checkpoints of rounds 7 and 11."""
    class Stop(Exception):
        pass

    def stop_after_round_12(line):
        if line["round"] == 12:
            raise Stop

    out = tmp_path_factory.mktemp("interrupted")
    with pytest.raises(Stop):
        train(_config(out), client=dask_client, on_round=stop_after_round_12)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "round-000007", "round-000011"]
    return out


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_latest_checkpoint_resumes_from_the_one_before(tmp_path, dask_client, reference,
                                                               interrupted, damage):
    out = Path(shutil.copytree(interrupted, tmp_path / "run"))
    DAMAGE[damage](out / "checkpoints" / "round-000011")
    # What a driver killed mid-write leaves: temporaries of write_atomic, save and the model.
    (out / ".metrics.jsonl.k1ll3d.tmp").write_text('{"round": 12')
    (out / ".model.npz.tmp.npz").write_bytes(b"PK")
    (out / "checkpoints" / ".round-000015.k1ll3d.tmp").mkdir()
    (out / "checkpoints" / ".round-000015.k1ll3d.tmp" / "state.npz").write_bytes(b"PK")
    log = []
    result = train(_config(out), client=dask_client, resume=True, log=log.append)
    assert any(x.startswith("skipping checkpoint round-000011") for x in log), log
    assert any("resuming" in x and "after round 7" in x for x in log), log
    assert_same_bits(result.params, reference)
    assert _metric_rounds(out) == list(range(ROUNDS))
    assert not [p.name for p in out.rglob(".*") if p.name != fs.MARKER], "temporaries left"


@pytest.mark.parametrize("changes", [{}, {"train.strategy": "async", "average.mix_every": "2",
                                          "asynchronous.order": "fixed"}], ids=["ipm", "async"])
def test_anchors_between_checkpoints_change_no_bit(dask_client, reference, changes):
    """An anchor every 3 rounds (no --out: gathered, not written; the run goes on from it as a
    fresh root) gives the weights of the run without anchors. Async goes on without redoing
    its in-flight updates: their outputs are re-rooted as they are applied."""
    import distributed
    expected = reference if not changes else train(_config(**changes), client=dask_client).params
    config = _config(**changes, anchor_every=3)
    with distributed.get_task_stream(dask_client) as stream:
        result = train(config, client=dask_client)
    assert_same_bits(result.params, expected)
    # Each replica's update of each round ran once: a train- task and its three picks.
    ran = Counter(str(t["key"]) for t in stream.data if "train-" in str(t["key"]))
    assert len(ran) == 4 * len(result.history) * config.train.replicas, ran
    assert set(ran.values()) == {1}, ran


def test_resume_reads_fields_added_since_a_checkpoint_at_their_defaults():
    from pipeline.outputs import resume
    from pipeline.core.errors import ResumeError
    now = _config().to_dict()
    old = {k: v for k, v in now.items() if k != "anchor_every"}
    old["train"] = {k: v for k, v in old["train"].items() if k != "lr_decay"}
    resume.check_same_run(old, {**now, "anchor_every": 7}, Path("run"))  # both added since
    with pytest.raises(ResumeError, match="train.lr_decay is 'none' there and 'cosine' now"):
        resume.check_same_run(old, {**now, "train": {**now["train"], "lr_decay": "cosine"}},
                              Path("run"))


# --- a long run gives everything back -----------------------------------------------------------


def _scheduler_tasks(client) -> int:
    return client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))


def _worker_memory(client) -> dict:
    """{worker: (keys held, bytes held, process RSS, task records)}. RSS after a collection and
    a ``malloc_trim``: what the process holds, not what glibc's arenas kept after freeing (CI saw
    a worker's untrimmed RSS grow 45 MiB over 273 rounds with nothing held). Task records: the
    ``TaskState``s the worker keeps, released ones included."""
    def probe(dask_worker):
        import ctypes
        import gc
        import psutil
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: the untrimmed figure
            pass
        return (len(dask_worker.data), dask_worker.state.nbytes,
                psutil.Process().memory_info().rss, len(dask_worker.state.tasks))
    return client.run(probe)


def _settle(read, target, timeout: float = 10.0):
    """Poll ``read()`` until it equals ``target`` (releases are asynchronous); the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if value == target or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _slope(points: dict) -> float:
    """Least-squares slope of ``{x: y}`` (x ascending) after taking out its largest rise
    between neighbours: a one-off step (a worker's heap first reaching a new high, ~8 MiB when
    it first runs an evaluate- or augment- task) is not growth; a leak rises at every sample.

    >>> _slope({0: 1.0, 10: 2.0, 20: 3.0, 30: 4.0})  # 0.1 raw; 25 samples keep 96 % of it
    0.07
    >>> _slope({0: 1.0, 10: 1.0, 20: 9.0, 30: 9.0})
    0.0
    """
    xs = list(points)
    rise, at = max((points[b] - points[a], b) for a, b in zip(xs, xs[1:]))
    ys = [y - rise if x >= at else y for x, y in points.items()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys))
                 / sum((x - mx) ** 2 for x in xs), 9)


# Distributed's own bounded histories off or short, so that what grows in the window is ours:
# the profiler's (a sample every 10 ms, kept 1000 s: ~20 KiB a round here) and the 1000-entry
# logs (transitions, stimuli, transfers: full after ~1000 rounds) cut to 50.
_QUIET_WORKERS = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
                  "DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH": "50"}
ANCHOR = 25  # rounds between anchors (fresh roots) in the long run; the default is 100


STEADY_FROM = 40  # rounds: after two epochs (16 rounds each) and their first evaluations


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("strategy", ["ipm", "async"])
def test_long_run_releases_every_key_and_byte(tmp_path, strategy):
    """304 rounds of ipm K=2 (or 608 async updates) with no checkpoint: the scheduler's tasks,
    each worker's task records and its RSS stay flat, and everything goes back to the baseline
    at the end.

    The leak this guards against: a worker keeps a released task's record while a task computed
    from it on that worker is alive, so an unbroken chain of rounds on one worker kept every
    round's records (~9 a round, ~48 KiB a round of RSS, 70 with the profiler on) until the end.
    Anchors (``anchor_every``) cut the chain; async's apply- chain too (``Async.reroot``)."""
    import distributed
    # K=2 x batch 8 on 256 images: 16 rounds of H=1 per epoch; 19 epochs = 304 rounds.
    cfg = _config(**{"train.replicas": 2, "average.mix_every": "1", "train.epochs": 19,
                     "checkpoint_every": 0, "anchor_every": ANCHOR, "train.strategy": strategy})
    samples: dict[int, int] = {}
    memory: dict[int, dict] = {}
    with subprocess_cluster(2, resources={"CPU": 1}, env=_QUIET_WORKERS) as cluster, \
            distributed.Client(cluster.address, set_as_default=False) as client:
        baseline_tasks = _scheduler_tasks(client)
        baseline = _worker_memory(client)

        def watch(line):
            # from round 40 on: the first two epochs hold the start (the workers' first tasks
            # import and load their compiled kernels, the first evaluations build their
            # convolution primitives; 157 tasks seen at round 10 for async, 218 at round 20 for
            # ipm in a CI run, 36-47 at every round after)
            if line["round"] % 10 == 0 and line["round"] >= STEADY_FROM:
                # the fewest of two looks 0.2 s apart, and of more for up to 5 s while that is
                # over 100: a leak stays, a burst of releases the scheduler has not handled yet
                # on a loaded machine does not (CI once read 129 at round 10 and 36-47 after
                # it; a run beside a pip install here 128 and 217 at rounds 10 and 20, then 37)
                fewest, looked = _scheduler_tasks(client), time.monotonic()
                while True:
                    time.sleep(0.2)
                    fewest = min(fewest, _scheduler_tasks(client))
                    if fewest < 100 or time.monotonic() - looked >= 5.0:
                        break
                samples[line["round"]] = fewest
                memory[line["round"]] = _worker_memory(client)

        result = train(cfg.replace(**{"cluster.scheduler": cluster.address}), on_round=watch)
        after_tasks = _settle(lambda: _scheduler_tasks(client), baseline_tasks)
        after = _settle(lambda: {w: m[:2] for w, m in _worker_memory(client).items()},
                        {w: m[:2] for w, m in baseline.items()})
    assert len(result.history) == 304
    # Bounded during the run: the rounds in flight (prefetch + one ahead) plus the data blocks,
    # the same at round 300 as at rounds 40-100.
    early, late = max(v for r, v in samples.items() if r <= 100), max(samples.values())
    assert late <= early + 10 and late < 120, samples
    # Each worker's records: at most the rounds since the last anchor (~9 a round) plus those
    # in flight and the data blocks (~220 measured); the chain reached 1700 by round 300.
    records = {w: max(m[w][3] for m in memory.values()) for w in baseline}
    assert all(n < 12 * ANCHOR + 100 for n in records.values()), (records, memory)
    # RSS over rounds 60..300, once the shortened histories are full: -10..6 KiB a round in 24
    # runs here; ~27 with the chain (RSS lags it: a freed chain's memory is reused first); one
    # small-cnn parameter set (74 KiB) kept a round reads ~70.
    slopes = {w: _slope({r: m[w][2] / 2**10 for r, m in sorted(memory.items()) if r >= 60})
              for w in baseline}
    assert all(s < 20 for s in slopes.values()), (slopes, memory)  # KiB of RSS a round
    # Back at the baseline after it: no key left on the scheduler, no data on the workers.
    assert after_tasks == baseline_tasks, (baseline_tasks, after_tasks)
    assert after == {w: m[:2] for w, m in baseline.items()}, (baseline, after)


# --- asynchronous updates -----------------------------------------------------------------------

ASYNC = {"train.strategy": "async", "average.mix_every": "2"}  # 10 rounds of 3 updates


@pytest.mark.cluster
@pytest.mark.parametrize("order", ["fixed", "arrival"])
def test_async_lost_worker(tmp_path, dask_client, order):
    """fixed: a lost worker changes nothing in the result; arrival: the run goes on, and the
    log replays to the weights it ended with."""
    changes = {**ASYNC, "asynchronous.order": order}
    lines = []
    with subprocess_cluster(3, resources={"CPU": 1}) as cluster:
        killer = Killer(cluster, {4: 0}, holding=True)
        try:
            result = train(_on_cluster(cluster, tmp_path, **changes), log=lines.append,
                           on_round=killer)
        except Exception as exc:  # the run's own lines and the scheduler's errors say why
            errors = [x for x in cluster.logs(tail=200_000).splitlines()
                      if " ERROR " in x or "missing dependency" in x]
            raise AssertionError(f"{exc}\nkilled: {killer.killed}\nlog:\n" + "\n".join(lines)
                                 + "\nscheduler:\n" + "\n".join(errors[:20])) from exc
        finally:
            killer.close()
    assert [k[0] for k in killer.killed] == [0], killer.killed
    assert _metric_rounds(tmp_path) == list(range(10))
    log = [json.loads(x) for x in (tmp_path / "updates.jsonl").read_text().splitlines()]
    assert [x["position"] for x in log if "position" in x] == list(range(30))
    if _replays(lines):
        assert any(x.get("event") == "replay" for x in log), log
    if order == "fixed":
        reference = train(_config(**changes), client=dask_client).params
    else:
        reference = train(_config(**changes, **{
            "asynchronous.replay_updates": str(tmp_path / "updates.jsonl")}),
            client=dask_client).params
    assert_same_bits(result.params, reference, (killer.killed, lines))
