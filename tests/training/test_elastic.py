"""Elastic runs: workers that join a run mid-way train from the next round, a worker retired
through Dask hands its replicas over at the next round boundary without a replay, and
``--adapt MIN:MAX`` runs the embedded cluster under Dask's adaptive scaling; the weights are the
same bits as on a fixed cluster of any size."""
import json

import pytest

from pipeline.core import keys
from pipeline.training import train
from tests.helpers import assert_same_bits, make_config

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BASE = {"data.source": "synthetic:192:48", "model.name": "small-cnn", "train.strategy": "ipm",
        "train.replicas": 3, "train.batch_size": 8, "average.mix_every": 2, "train.epochs": 2,
        "train.lr": 0.01, "augment.policy": "cifar", "progress": False, "checkpoint_every": 3,
        "seed": 7}
JOIN_AFTER = 1  # the round after which the cluster grows or shrinks


def _cluster(n: int):
    import distributed
    from threadpoolctl import threadpool_limits
    threadpool_limits(1)  # in-process workers share the process's BLAS (tests/conftest.py)
    cluster = distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=False,
                                       dashboard_address="127.0.0.1:0")
    return cluster, distributed.Client(cluster, set_as_default=False)


def _run(tmp_path, name: str, workers: int, on_round=None, stream: bool = False):
    """(result, task-stream records if ``stream``, {address: name} at the end, the rounds
    published for the /training page)."""
    from distributed import get_task_stream

    from pipeline.outputs.dashboard import dashboard_events, training_events
    cluster, client = _cluster(workers)
    with cluster, client:
        hook = (lambda line: on_round(line, cluster, client)) if on_round else None
        config = make_config(BASE, out=str(tmp_path / name))
        with get_task_stream(client=client) as ts:
            result = train(config, client=client, on_round=hook,
                           hooks=[dashboard_events(client, run=name, page=False)])
        names = {a: str(w["name"]) for a, w in client.scheduler_info()["workers"].items()}
        events = training_events(client, name)
    return result, (ts.data if stream else None), names, events


def _lines(result) -> list:
    with open(f"{result.out}/metrics.jsonl") as lines:
        return [json.loads(x) for x in lines]


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """The weights of fixed 3-worker and 1-worker runs."""
    tmp = tmp_path_factory.mktemp("fixed")
    three = _run(tmp, "three", 3)[0]
    one = _run(tmp, "one", 1)[0]
    assert_same_bits(three.params, one.params)
    return three


def _train_rounds_by_worker(records) -> dict:
    """{worker address: {round of each train- task it ran}}."""
    out: dict = {}
    for r in records:
        if keys.stage_of(r["key"]) == "train" and keys.round_of(r["key"]) is not None:
            out.setdefault(r["worker"], set()).add(keys.round_of(r["key"]))
    return out


def test_workers_that_join_train_from_the_next_round_with_the_same_bits(tmp_path, fixed):
    joined_at = {}

    def grow(line, cluster, client):
        if line["round"] == JOIN_AFTER:
            cluster.scale(3)
            client.wait_for_workers(3, timeout=60)
            joined_at.update({a: line["round"] for a in client.scheduler_info()["workers"]})

    grown, records, names, events = _run(tmp_path, "grown", 1, grow, stream=True)
    assert_same_bits(grown.params, fixed.params)
    by_worker = _train_rounds_by_worker(records)
    first = sorted(by_worker, key=lambda a: min(by_worker[a]))[0]
    newcomers = [a for a in names if a != first]
    assert len(newcomers) == 2
    later = set(range(JOIN_AFTER + 2, len(grown.history)))  # placed after the join was seen
    for address in newcomers:  # each newcomer trains a replica in every round after the join
        assert later <= by_worker.get(address, set()), (address, by_worker)
    lines = _lines(grown)
    assert [x["workers"]["count"] for x in lines[:JOIN_AFTER + 1]] == [1] * (JOIN_AFTER + 1)
    assert all(x["workers"]["count"] == 3 for x in lines[JOIN_AFTER + 2:])
    joins = [x["workers"]["joined"] for x in lines if x["workers"].get("joined")]
    assert sorted(n for j in joins for n in j) == sorted(names[a] for a in newcomers)
    assert all(x["replayed"] == 0 for x in lines)
    # one worker holds every input; the newcomers fetch the state and shards they train on
    assert all(x["transfers"] == 0 for x in lines[:JOIN_AFTER + 1])
    assert all(x["transfers"] > 0 for x in lines[JOIN_AFTER + 2:]), [x["transfers"] for x in lines]
    assert [e["workers"] for e in events] == [x["workers"]["count"] for x in lines]  # /training


def test_a_retired_worker_hands_over_without_a_replay(tmp_path, fixed):
    retired = []

    def shrink(line, cluster, client):
        if line["round"] == JOIN_AFTER:
            workers = sorted(client.scheduler_info()["workers"])
            retired.extend(client.retire_workers(workers[1:], close_workers=True))

    shrunk, _, names, _ = _run(tmp_path, "shrunk", 3, shrink)
    assert len(retired) == 2 and len(names) == 1
    assert_same_bits(shrunk.params, fixed.params)
    lines = _lines(shrunk)
    assert all(x["replayed"] == 0 for x in lines), [x["replayed"] for x in lines]
    assert lines[0]["workers"]["count"] == 3 and lines[-1]["workers"]["count"] == 1
    assert sum(len(x["workers"].get("left", ())) for x in lines) == 2



def test_adapt_grows_for_waiting_replicas_and_records_workers(tmp_path, fixed):
    import distributed

    def wait_for_growth(line):  # a worker process starts in ~3 s: longer than these rounds
        if line["round"] == JOIN_AFTER:
            distributed.get_client().wait_for_workers(2, timeout=60)

    config = make_config(BASE, out=str(tmp_path / "adapt"),
                         **{"cluster.adapt": "1:2", "cluster.dashboard_address": ":0"})
    result = train(config, on_round=wait_for_growth)  # the embedded cluster, under Adaptive
    assert_same_bits(result.params, fixed.params)
    lines = _lines(result)
    assert len(lines) == 8 and all(x["replayed"] == 0 for x in lines)
    counts = [x["workers"]["count"] for x in lines]
    assert counts[0] == 1 and 2 in counts and all(1 <= c <= 2 for c in counts), counts
    assert any(x["workers"].get("joined") for x in lines)
    assert all(len(x["workers"]["names"]) == x["workers"]["count"] for x in lines)


def test_a_replica_keeps_its_thread_share_when_placed_again(monkeypatch):
    """With ``--cpu-kernels chainer`` BLAS's threads are part of the arithmetic: a replica placed
    again on a worker with more threads keeps the share the attempt started with."""
    from pipeline.training import graph as graphs
    from pipeline.training.placement import Placement
    placements = iter([Placement(("a", "a"), (1, 1), {}, False, True),
                       Placement(("a", "b"), (2, 2), {}, False, True)])
    monkeypatch.setattr(graphs, "place", lambda *args: next(placements))
    graph = object.__new__(graphs.RoundGraph)
    graph.client = graph.config = graph.train_resources = graph.augment_resources = None
    graph._plan, graph._placement, graph._shares = "plan", None, ()
    assert graph.placement.threads == (1, 1)
    graph.replace()
    graph._plan = "plan"
    assert graph.placement.homes == ("a", "b") and graph.placement.threads == (1, 1)
