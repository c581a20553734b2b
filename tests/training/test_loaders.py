"""Loader workers: decode- and augment- tasks on their own processes, train- and evaluate- on the
training workers (`cluster.loader_workers`, `train.cpu_resource`), with the same bytes as a run
without them."""
from __future__ import annotations

import pytest

from pipeline.cli import parser as cli
from pipeline.training import graph
from pipeline.core import keys
from pipeline.core.config import Config
from pipeline.training.loop import train
from tests.images import write_folder
from tests.helpers import assert_same_bits, make_config


BASE = {"data.image_size": 32, "data.cache": "off",
        "data.decode_chunk": 5, "model.name": "small-cnn", "train.strategy": "ipm",
        "train.replicas": 2, "train.batch_size": 4, "train.epochs": 1.0,
        "average.mix_every": "2", "augment.policy": "resized-crop", "augment.chunk": 8,
        "progress": False}


def _config(source: str, **fields) -> Config:
    return make_config(BASE, **{"data.source": source, **fields})


class _Spy:
    """A run-output hook that reads, before the cluster closes, who ran which stage."""

    def start(self, info):
        self.client = info.client

    def __call__(self, line):
        pass

    def close(self):
        from pipeline.cluster.resources import worker_resources
        self.resources = worker_resources(self.client)
        self.stages: dict[str, set] = {}
        self.moves: dict = {}  # key -> worker of each shard prefetched to its train worker
        for rec in self.client.get_task_stream():
            stage = keys.stage_of(rec["key"]) if isinstance(rec["key"], tuple) else None
            if stage and rec["key"][-1] == "move":
                stage = "move"
                self.moves[rec["key"]] = rec["worker"]
            if stage:
                self.stages.setdefault(stage, set()).add(rec["worker"])
        # tasks distributed's work stealing took from a busy worker to an idle one
        self.stolen = {msg[1] for _, msg in self.client.get_events("stealing")
                       if msg[0] == "confirm"}


def test_loader_workers_load_trainers_train_and_the_bytes_stay(tmp_path, dask_client):
    root = write_folder(tmp_path / "f", classes=2, per_class=10)
    spy, lines = _Spy(), []
    split = train(_config(str(root), **{"cluster.workers": 1, "cluster.loader_workers": 1,
                                        "cluster.pin_replicas": True,
                                        "cluster.dashboard_address": "127.0.0.1:0"}),
                  log=lines.append, hooks=[spy])
    plain = train(_config(str(root)), dask_client, log=lambda m: None)

    roles = {addr: tuple(sorted(res)) for addr, res in spy.resources.items()}
    assert sorted(roles.values()) == [("CPU",), ("RANK-0", "TRAIN")]  # a loader, a trainer
    loader = next(a for a, r in roles.items() if r == ("CPU",))
    trainer = next(a for a, r in roles.items() if "TRAIN" in r)
    assert spy.stages["decode"] == {loader} and spy.stages["augment"] == {loader}
    assert spy.stages["train"] == {trainer} and spy.stages["evaluate"] == {trainer}
    # each shard went to the trainer ahead of its round: a soft pin, so distributed's work
    # stealing may hand a move to the idle loader while the trainer is busy (in a fresh-clone CI
    # run a move ran there; the train- task then fetches that shard, the same bytes)
    assert spy.moves and {w for k, w in spy.moves.items() if k not in spy.stolen} <= {trainer}
    assert any("train-/evaluate- tasks on the workers advertising TRAIN, decode-/augment- on "
               "those advertising CPU" in m for m in lines)
    a, b = split.params, plain.params
    assert_same_bits(a, b)
    assert split.history[-1]["test_acc"] == plain.history[-1]["test_acc"]


class _Placement(_Spy):
    """Also reads, per train- task of the run, the RANK-i resource of the worker that ran it."""

    def close(self):
        super().close()
        rank = {a: next((n for n in res if n.startswith("RANK-")), None)
                for a, res in self.resources.items()}
        self.ranks = {(rec["key"][1], rec["key"][2]): rank[rec["worker"]]
                      for rec in self.client.get_task_stream()
                      if isinstance(rec["key"], tuple) and len(rec["key"]) == 3
                      and keys.stage_of(rec["key"]) == "train"}


def test_beside_loaders_each_replica_stays_on_its_ranked_training_worker(tmp_path, dask_client):
    # Two training workers and a loader: a soft pin is unsafe there (work stealing could hand a
    # train- task to the loader), so the training workers advertise RANK-0 and RANK-1 and
    # replica k's train- tasks ask for RANK-k: every round, each replica on its own worker.
    root = write_folder(tmp_path / "f", classes=2, per_class=16)
    spy = _Placement()
    fields = {"train.epochs": 2.0, "average.mix_every": "1"}
    split = train(_config(str(root), **fields, **{
        "cluster.workers": 2, "cluster.loader_workers": 1, "cluster.threads_per_worker": 1,
        "cluster.dashboard_address": "127.0.0.1:0"}), hooks=[spy], log=lambda m: None)
    plain = train(_config(str(root), **fields), dask_client, log=lambda m: None)
    assert sorted(map(sorted, spy.resources.values())) == [
        ["CPU"], ["RANK-0", "TRAIN"], ["RANK-1", "TRAIN"]]
    assert len(spy.ranks) == 2 * len(split.history) > 8
    assert all(rank == f"RANK-{k}" for (_, k), rank in spy.ranks.items()), spy.ranks
    a, b = split.params, plain.params
    assert_same_bits(a, b)


class _Workers:
    """A client stand-in that only answers ``scheduler_info``: two trainers and, unless
    ``loader=False``, one loader."""

    def __init__(self, loader: bool = True, ranks: bool = False):
        self.loader, self.ranks = loader, ranks

    def scheduler_info(self, n_workers=-1):
        # Ranks on purpose against the names' order: the ranks decide.
        workers = {
            "tcp://127.0.0.1:1": {"name": "loader-0", "resources": {"CPU": 1}},
            "tcp://127.0.0.1:2": {"name": "cpu-0", "resources": {
                "TRAIN": 1, **({"RANK-1": 1} if self.ranks else {})}},
            "tcp://127.0.0.1:3": {"name": "cpu-1", "resources": {
                "TRAIN": 1, **({"RANK-0": 1} if self.ranks else {})}}}
        if not self.loader:
            del workers["tcp://127.0.0.1:1"]
        return {"workers": workers}


def test_pinned_replicas_go_to_the_training_workers_and_never_beside_a_loader():
    cfg = Config().replace(**{"cluster.pin_replicas": True, "train.replicas": 3})

    def pins(client, key="workers"):
        g = graph.RoundGraph(client, None, cfg, n_classes=10, device="cpu",
                             train_resources={"TRAIN": 1}, augment_resources={"CPU": 1})
        return [g.placement.pinned(k, {"TRAIN": 1}).get(key) for k in range(3)]

    assert pins(_Workers(loader=False)) == [
        ["tcp://127.0.0.1:2"], ["tcp://127.0.0.1:3"], ["tcp://127.0.0.1:2"]]
    # A loader lacks TRAIN: a soft pin would let work stealing hand a train- task to it.
    assert pins(_Workers()) == [None, None, None]
    assert pins(_Workers(), "resources") == [{"TRAIN": 1}] * 3
    # Training workers with ranks (as the embedded cluster starts them beside loaders or GPU
    # workers): held to their rank by resource, which no loader has.
    assert pins(_Workers(ranks=True)) == [None, None, None]
    assert pins(_Workers(ranks=True), "resources") == [
        {"TRAIN": 1, "RANK-0": 1}, {"TRAIN": 1, "RANK-1": 1}, {"TRAIN": 1, "RANK-0": 1}]


def test_loader_workers_option_and_its_check():
    args = cli.build_parser().parse_args(["train", "--loader-workers", "3", "--cpu-resource",
                                          "BIG"])
    assert getattr(args, "cluster.loader_workers") == 3
    assert getattr(args, "train.cpu_resource") == "BIG"
    with pytest.raises(ValueError, match=r"cluster\.loader_workers must be in \[0, 1024\]"):
        Config().replace(**{"cluster.loader_workers": -1}).validate()


def test_replicas_are_pinned_by_default_and_no_pin_replicas_lets_dask_place_them():
    # Unpinned, the scheduler stacked both replicas of K=2 on one of two workers in up to 27 of
    # 32 rounds (benchmarks/placement.py); pinned, replica k stays on worker k mod W.
    assert Config().cluster.pin_replicas
    parse = cli.build_parser().parse_args
    assert getattr(parse(["train"]), "cluster.pin_replicas") is None  # the config's default
    assert getattr(parse(["train", "--no-pin-replicas"]), "cluster.pin_replicas") is False
    assert getattr(parse(["train", "--pin-replicas"]), "cluster.pin_replicas") is True

    def pins(cfg):
        g = graph.RoundGraph(_Workers(loader=False), None, cfg, n_classes=10, device="cpu",
                             train_resources=None, augment_resources=None)
        return [g.placement.pinned(k).get("workers") for k in range(2)]

    cfg = Config().replace(**{"train.replicas": 2})
    assert pins(cfg) == [["tcp://127.0.0.1:2"], ["tcp://127.0.0.1:3"]]
    assert pins(cfg.replace(**{"cluster.pin_replicas": False})) == [None, None]


class _KillTrainer(_Spy):
    """Kills the training worker's process (SIGKILL) once round 0 is reported; its nanny starts
    a new one, which the replay waits for."""

    def __call__(self, line):
        import os
        import signal
        from pipeline.cluster.resources import worker_resources
        if line["round"] != 0:
            return
        roles = worker_resources(self.client)
        self.loader = next(a for a, r in roles.items() if "CPU" in r)
        trainer = [a for a, r in roles.items() if "TRAIN" in r]
        pid = self.client.run(os.getpid, workers=trainer)[trainer[0]]
        os.kill(pid, signal.SIGKILL)
        self.killed = pid


def test_a_lost_training_worker_is_waited_for_and_the_bytes_stay(tmp_path, dask_client):
    root = write_folder(tmp_path / "f", classes=2, per_class=10)
    spy, lines = _KillTrainer(), []
    fields = {"train.epochs": 3.0}
    split = train(_config(str(root), **fields, **{"cluster.workers": 1, "cluster.loader_workers": 1,
                                                  "cluster.dashboard_address": "127.0.0.1:0"}),
                  log=lines.append, hooks=[spy])
    plain = train(_config(str(root), **fields), dask_client, log=lambda m: None)
    assert spy.killed and len(split.history) == len(plain.history) > 2
    assert len(spy.stages["train"]) == 2 and spy.loader not in spy.stages["train"], (lines, spy.resources, spy.stages)  # old, new
    a, b = split.params, plain.params
    assert_same_bits(a, b, lines)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_a_replay_without_training_workers(monkeypatch, device):
    """CPU runs go on on the workers left (as they would have started); GPU runs stop."""
    from types import SimpleNamespace

    from pipeline.cluster import resources
    from pipeline.training import recovery
    from pipeline.core.errors import ClusterError

    def missing(client, name, timeout, wait=False):
        assert wait  # an embedded cluster's nanny restarts a lost worker: wait for it
        raise ClusterError(f"no worker advertises resource {name!r}")

    monkeypatch.setattr(resources, "require_workers", lambda client, n, timeout: None)
    monkeypatch.setattr(resources, "require_resource", missing)
    lines = []
    name = "TRAIN" if device == "cpu" else "GPU"
    graph = SimpleNamespace(device=device, train_resources={name: 1})

    def await_workers():
        recovery.await_workers(None, graph, 1.0, lines.append, replay_from=4, hint="; here")

    if device == "gpu":
        with pytest.raises(ClusterError, match="cannot replay from round 4: no worker advertises"
                                               ".*; here$"):
            await_workers()
        return
    await_workers()
    assert graph.train_resources is None
    assert lines == ["no worker advertises TRAIN any more: training on any worker"]
