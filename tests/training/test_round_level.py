"""The round level (issue 27 item 4, issue 28): a round's shard is made on, or moved to, the worker
its train- task runs on while the round before trains; the averaged state stays on the workers
between rounds. Placement only: the same bytes as without it."""
from __future__ import annotations

from pipeline.core import keys
from pipeline.training import graph
from pipeline.training.loop import train
from tests.helpers import assert_same_bits, make_config

BASE = {"data.source": "synthetic:192:32", "model.name": "small-cnn", "train.strategy": "ipm",
        "train.replicas": 2, "train.batch_size": 16, "train.epochs": 1.0,
        "average.mix_every": "2", "augment.policy": "cifar", "progress": False,
        "checkpoint_every": 0, "seed": 3, "train.optimizer": "adam", "train.lr": 1e-3,
        "cluster.pin_replicas": True}


def _stream(dask_scheduler):
    from distributed.diagnostics.task_stream import TaskStreamPlugin
    if TaskStreamPlugin.name not in dask_scheduler.plugins:
        dask_scheduler.add_plugin(TaskStreamPlugin(dask_scheduler))
    return dask_scheduler.plugins[TaskStreamPlugin.name]


def _stream_index(dask_scheduler) -> int:
    return _stream(dask_scheduler).index


def _records_since(index: int, dask_scheduler) -> list:
    """(key, worker) of every task-stream record appended after the count ``index``: by
    position, not by the workers' clocks (a time window dropped a record of a run in CI)."""
    plugin = _stream(dask_scheduler)
    new = list(plugin.buffer)[len(plugin.buffer) - min(plugin.index - index, len(plugin.buffer)):]
    return [(rec["key"], rec["worker"]) for rec in new]


class _Where:
    """A run-output hook that reads, before the run ends, which worker ran each augment-,
    train-, average- and evaluate- task of this run (``workers[stage-token][coords]``)."""

    def start(self, info):
        self.client = info.client
        self.first = self.client.run_on_scheduler(_stream_index)  # this run's records only

    def __call__(self, line):
        pass

    def close(self):
        self.workers = {}
        for key, worker in self.client.run_on_scheduler(_records_since, self.first):
            if isinstance(key, tuple) and \
                    keys.stage_of(key) in ("augment", "train", "average", "evaluate"):
                self.workers.setdefault(key[0], {})[key[1:]] = worker


def _run(client, **fields):
    where = _Where()
    result = train(make_config(BASE, **fields), client, log=lambda m: None, hooks=[where])
    return result, where.workers


def _pairs(workers: dict) -> list:
    """(augment worker, train worker) per (round, replica) of the one run in ``workers``."""
    token = next(k.split("-", 1)[1] for k in workers if k.startswith("train-"))
    shards, trains = workers["augment-" + token], workers["train-" + token]
    return [(shards[c], trains[c]) for c in sorted(trains) if len(c) == 2]


def test_shards_are_made_where_their_replica_trains_and_the_bytes_stay(dask_client,
                                                                         monkeypatch):
    prefetched, workers = _run(dask_client, **{"data.source": "synthetic:192:200"})
    pairs = _pairs(workers)
    assert len(pairs) == 2 * len(prefetched.history)
    assert len({t for _, t in pairs}) == 2  # the replicas on their two workers
    assert all(a == t for a, t in pairs), pairs
    token = next(k.split("-", 1)[1] for k in workers if k.startswith("train-"))
    trains = workers["train-" + token]
    home = {k: trains[(0, k)] for k in (0, 1)}
    # The picks of a train- task (params, opt, metrics) run where it ran: none fetches the
    # whole result to another worker.
    picks = {c: w for c, w in trains.items() if len(c) == 3}
    assert picks and all(w == trains[c[:2]] for c, w in picks.items()), picks
    # K = 2 on two workers: `gather` adds both states on each replica's worker (Adam: params
    # and moments), each splits its own copy, and each evaluates its half of the test chunks.
    average = workers["average-" + token]
    sums = {c: w for c, w in average.items() if c[1] == "local"}
    assert sums and all(w == home[c[2]] for c, w in sums.items()), sums
    unpacked = {c: w for c, w in average.items() if c[1] == "unpack" and len(c) == 3}
    assert unpacked and all(w == home[c[2]] for c, w in unpacked.items()), unpacked
    evaluated = workers["evaluate-" + token]
    assert {i for _, i in evaluated} == {0, 1}  # 200 test images: two chunks (eval_chunk_size)
    assert all(w == home[i % 2] for (_, i), w in evaluated.items()), evaluated

    from pipeline.training.placement import Placement
    monkeypatch.setattr(Placement, "augment_where", lambda self, replica: {})
    monkeypatch.setattr(graph.RoundGraph, "_to_trainer", lambda self, shard, replica, key: shard)
    plain, _ = _run(dask_client, **{"data.source": "synthetic:192:200"})
    assert_same_bits(prefetched.params, plain.params)
    assert prefetched.history[-1]["test_acc"] == plain.history[-1]["test_acc"]
    tree, _ = _run(dask_client, **{"data.source": "synthetic:192:200",
                                   "average.algorithm": "tree"})  # one sum, one split
    assert_same_bits(prefetched.params, tree.params)
    assert [h.get("test_loss") for h in tree.history] == \
        [h.get("test_loss") for h in prefetched.history]


def test_replicas_as_threads_of_one_worker_round_as_one_replica_per_worker(dask_client):
    """Two replicas as the two threads of one worker (their average reads both states in place,
    moving no bytes) give the bytes of one replica per one-thread worker: each caps BLAS at its
    share of the worker's threads (``placement.thread_shares``), 1, as a one-thread worker does."""
    import distributed
    per_worker, _ = _run(dask_client)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  dashboard_address="127.0.0.1:0") as cluster, \
            distributed.Client(cluster, set_as_default=False) as client:
        threads, workers = _run(client)
    assert len({t for _, t in _pairs(workers)}) == 1
    assert_same_bits(per_worker.params, threads.params)
    assert per_worker.history[-1]["test_acc"] == threads.history[-1]["test_acc"]


def test_thread_share_is_the_workers_threads_over_its_replicas():
    from pipeline.training.placement import thread_shares
    assert thread_shares(("a", "a"), {"a": 2}) == (1, 1)
    assert thread_shares(("a",), {"a": 2}) == (2,)  # single: both cores
    assert thread_shares(("a", "b", "a"), {"a": 4, "b": 1}) == (2, 1, 2)
    assert thread_shares((None,), {}) == (0,)  # not placed: the worker's threads


def test_single_on_a_two_thread_worker_uses_both_threads_with_the_bits_of_one(monkeypatch):
    """``single`` on one 2-thread worker runs each convolution's chunks on 2 threads over one
    BLAS thread (``Backend.using_threads``): the bytes of ``single`` on a 1-thread worker."""
    import distributed
    from pipeline.backends.chainer.cpu_kernels import sharing
    shares, run_shares = [], sharing.run

    def spy(fn, parts):
        shares.append(len(parts))
        return run_shares(fn, parts)

    monkeypatch.setattr(sharing, "run", spy)
    results = {}
    for threads in (1, 2):
        with distributed.LocalCluster(n_workers=1, threads_per_worker=threads, processes=False,
                                      dashboard_address="127.0.0.1:0") as cluster, \
                distributed.Client(cluster, set_as_default=False) as client:
            shares.clear()
            results[threads], _ = _run(client, **{"train.strategy": "single",
                                                  "train.replicas": 1})
            results[threads, "shares"] = max(shares)
    assert results[1, "shares"] == 1 and results[2, "shares"] == 2
    assert_same_bits(results[1].params, results[2].params)
    assert results[1].history[-1]["test_acc"] == results[2].history[-1]["test_acc"]
