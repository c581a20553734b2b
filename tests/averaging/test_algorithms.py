"""The averaging algorithms (tree, sharded, hierarchical): the pure pieces (addition order, shards,
placement) against NumPy and against each other, and the Dask graphs on an in-process cluster
whose workers are told apart as hosts: the same bytes whatever the algorithm, shard count and
placement."""
import itertools
import pickle

import numpy as np
import pytest
from distributed import Client, LocalCluster

from pipeline.averaging import exact
from pipeline.averaging import algorithms
from pipeline.averaging import cost
from pipeline.averaging import slices
from pipeline.averaging.algorithms import ALGORITHMS, Context, base
from pipeline.core.config import AverageConfig
from pipeline.averaging.placement import place
from pipeline.averaging.order import build, evaluate, frontier, ident, span
from pipeline.averaging.reduction import reduce_local
from tests.helpers import make_states, same_bits

TOKEN = "0a1b2c3d"


# States whose float64 sums are not exact: only the same order of additions gives the same bits.
SPREAD = 30


def tree_mean(states, fan_in):
    return reduce_local(states, exact.combine, exact.finalize, fan_in=fan_in,
                        combine_finalize=exact.combine_finalize)


# ---- the addition order ---------------------------------------------------------------------

@pytest.mark.parametrize("k,fan_in", [(1, 2), (2, 2), (5, 2), (7, 3), (8, 4), (13, 4)])
def test_nodes_evaluate_to_the_graph_tree(k, fan_in):
    states = make_states(k, seed=k, spread=SPREAD)
    root = build(k, fan_in)
    whole = evaluate(root, dict(enumerate(states)), exact.combine,
                     exact.combine_finalize)
    assert same_bits(whole, tree_mean(states, fan_in))


@pytest.mark.parametrize("seed", range(6))
def test_a_frontier_computed_elsewhere_gives_the_same_bits(seed):
    rng = np.random.default_rng(seed)
    k, fan_in = int(rng.integers(2, 12)), int(rng.integers(2, 5))
    states = make_states(k, seed=seed, dtype=np.float64, spread=SPREAD)
    root = build(k, fan_in)
    local = set(rng.choice(k, size=int(rng.integers(1, k + 1)), replace=False).tolist())
    nodes = frontier(root, local)
    covered = [r for n in nodes for r in range(*span(n))]
    assert covered == sorted(covered) and set(covered) == local  # each local replica once
    known = dict(enumerate(states))
    for node in nodes:  # computed "on the host", then finished elsewhere
        known[ident(node)] = evaluate(root, dict(enumerate(states)), exact.combine,
                                      exact.combine_finalize, top=node)
    out = evaluate(root, known, exact.combine, exact.combine_finalize)
    assert same_bits(out, tree_mean(states, fan_in))


def test_a_different_order_would_give_different_bits():
    """Why a fixed order matters: these states' float64 sums are not exact."""
    states = make_states(7, seed=1, dtype=np.float64, spread=SPREAD)
    assert not same_bits(tree_mean(states, 2), tree_mean(states, 3))


# ---- shards -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n_shards", [1, 2, 3, 7, 50])
def test_shards_cover_every_element_once_balanced_by_bytes(n_shards):
    state = {"/a": np.zeros((5, 3), np.float32), "/b": np.zeros(7, np.float64),
             "/N": np.array(2), "/c": np.zeros(4, np.float16)}
    layout = slices.layout_of(state, n_shards)
    seen = {key: [] for key, _, _ in layout.entries}
    for s in range(n_shards):
        nbytes = 0
        for key, lo, hi in layout.bounds(s):
            seen[key] += range(lo, hi)
            nbytes += (hi - lo) * state[key].itemsize
        assert nbytes <= layout.nbytes / n_shards + 8  # within one element of an even cut
    assert all(seen[k] == list(range(state[k].size)) for k in seen)
    pieces = [slices.take(state, n_shards, s) for s in range(n_shards)]
    assert same_bits(slices.assemble(pieces), state)


def test_take_is_a_view_and_a_partial_is_cut_at_the_same_elements():
    state = make_states(1, seed=0, spread=SPREAD)[0]
    piece = slices.take(state, 3, 1)
    assert all(np.shares_memory(v, state[k]) for k, v in piece.value.items())
    partial = exact.leaf(state)
    cut = slices.take(partial, 3, 1)
    assert cut.layout[:3] == piece.layout[:3]
    assert {k: v.size for k, v in cut.value.sums.items()} == \
        {k: v.size for k, v in piece.value.items()}


def test_pieces_of_different_states_are_refused():
    a, b = make_states(2, seed=0, spread=SPREAD)
    b = {**b, "/conv1/W": b["/conv1/W"][:3]}
    with pytest.raises(ValueError, match="different entries"):
        slices.reduce_pieces({0: slices.take(a, 2, 0), 1: slices.take(b, 2, 0)}, build(2, 2))
    with pytest.raises(ValueError, match="shards 0..1"):
        slices.assemble([slices.take(a, 2, 1), slices.take(a, 2, 0)])


# ---- placement --------------------------------------------------------------------------------

def test_placement_is_contiguous_balanced_and_deterministic():
    hosts = {"10.0.0.10": ["tcp://10.0.0.10:2", "tcp://10.0.0.10:1"],
             "10.0.0.9": ["tcp://10.0.0.9:5"]}
    p = place(hosts, 6)
    assert p.host_names == ("10.0.0.9", "10.0.0.10")  # numeric, not string order
    assert p.replica_host == (0, 0, 1, 1, 1, 1)
    assert p.replica_worker[2:] == ("tcp://10.0.0.10:1",) * 2 + ("tcp://10.0.0.10:2",) * 2
    assert place(dict(reversed(list(hosts.items()))), 6) == p
    assert place(hosts, 2).replica_host == (0, 1)


# ---- the graphs -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        yield c


def layouts(workers):
    """Three ways to see the same four workers: 3 hosts (2+1+1), one host, 4 hosts."""
    return [{"a": workers[:2], "b": workers[2:3], "c": workers[3:]}, {"a": workers},
            {str(i): [w] for i, w in enumerate(workers)}]


def mixed_states(k, seed):
    """float64 entries whose sums are inexact, float32 and float16 ones, an integer counter."""
    return [{**s, "/h": s["/bn1/avg_mean"].astype(np.float16)}
            for s in make_states(k, seed, dtype=np.float64, spread=SPREAD)]


def test_every_algorithm_shard_count_and_placement_gives_the_same_bits(client):
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    combos = list(itertools.product(layouts(workers), ALGORITHMS))
    for k in (1, 3, 5, 8):
        states = mixed_states(k, seed=k)
        expected = tree_mean(states, 2)
        futures = client.scatter(states)
        for i, (hosts, name) in enumerate(combos):
            n_shards = (1, 3, 7)[(i + k) % 3]
            ctx = Context(client, "average", TOKEN, (k, i), 2, place(hosts, k), n_shards, k)
            copies = client.gather(ALGORITHMS[name].allreduce(ctx, futures))
            assert len(copies) == k and all(same_bits(c, expected) for c in copies), \
                (name, k, n_shards, hosts)


def test_reduce_and_broadcast_give_the_mean_and_the_value(client):
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    states = mixed_states(5, seed=0)
    futures = client.scatter(states)
    for i, (hosts, name) in enumerate(itertools.product(layouts(workers), ALGORITHMS)):
        ctx = Context(client, "average", TOKEN, ("rb", i), 2, place(hosts, 5), 2 + i % 2, 5)
        assert same_bits(client.gather(ALGORITHMS[name].reduce(ctx, futures)),
                          tree_mean(states, 2))
        sent = client.gather(ALGORITHMS[name].broadcast(ctx._replace(coords=("b", i)),
                                                        futures[0]))
        assert len(sent) == 5 and all(same_bits(s, states[0]) for s in sent)


def test_keys_are_average_tasks_of_the_round(client):
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    states = client.scatter(make_states(4, seed=0, spread=SPREAD))
    ctx = Context(client, "average", "deadbeef", (7,), 2, place(layouts(workers)[0], 4), 3, 4)
    out = ALGORITHMS["hierarchical"].allreduce(ctx, states)
    client.gather(out)
    assert {f.key for f in out} == {("average-deadbeef", 7, "gather", 0),
                                    ("average-deadbeef", 7, "gather", 1),
                                    ("average-deadbeef", 7, "gather", 2)}
    steps = {ts[2] for ts in client.run_on_scheduler(
        lambda dask_scheduler: [k for k in dask_scheduler.tasks if isinstance(k, tuple)
                                and k[0] == "average-deadbeef"])}
    assert steps <= {"local", "take", "reduce", "gather"}


def test_gather_adds_on_every_worker_holding_replicas(client):
    """``gather``: one sum per worker holding replicas, run there, every copy the tree's bits;
    on one host the graph's pins (``homes``) place them; unplaced, one sum for all."""
    from pipeline.averaging.algorithms import gather
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])[:2]
    states = mixed_states(4, seed=2)
    futures = client.scatter(states)
    placed = Context(client, "average", TOKEN, ("g", 0), 2, place({"a": workers}, 4), 1, 4)
    pinned = Context(client, "average", TOKEN, ("g", 1), 2, None, 1, 4,
                     homes=(workers[0], workers[0], workers[1], workers[1]))
    for ctx in (placed, pinned):
        copies = gather.allreduce(ctx, futures)
        assert [c.key for c in copies] == [ctx.key("local", i) for i in (0, 0, 1, 1)]
        assert all(same_bits(c, tree_mean(states, 2)) for c in client.gather(copies))
        held = client.who_has(copies)
        assert [set(held[c.key]) for c in copies] == [{workers[i]} for i in (0, 0, 1, 1)]
    loose = Context(client, "average", TOKEN, ("g", 2), 2, None, 1, 4)
    assert len({c.key for c in gather.allreduce(loose, futures)}) == 1


@pytest.mark.parametrize("fn", [base.copy, base.done, base.local_sum, base.reduce_shard,
                                base.assemble, slices.take, slices.reduce_pieces])
def test_task_functions_pickle_round_trip(fn):
    assert pickle.loads(pickle.dumps(fn)) is fn


# ---- choosing an algorithm --------------------------------------------------------------------

def test_auto_picks_gather_or_the_tree_on_one_host_and_the_cost_model_across_hosts():
    cfg = AverageConfig()
    one = place({"h": ["w0", "w1", "w2", "w3"]}, 4)
    assert algorithms.choose(one, 1e8, cfg)[0] == "tree"
    # Two workers on one host: each adds both states itself (the same bytes, both ways at
    # once); one worker (replicas as its threads): the same single sum as the tree's root.
    for workers in (["w0", "w1"], ["w0"]):
        assert algorithms.choose(place({"h": workers}, 2), 1e8, cfg)[0] == "gather"
    assert algorithms.choose(place({"h": ["w0", "w1"]}, 4), 1e8, cfg)[0] == "gather"
    four = place({f"h{i}": [f"w{i}"] for i in range(4)}, 4)
    name, shards, why = algorithms.choose(four, 1e8, cfg)
    assert name in ("sharded", "hierarchical") and shards == 4 and "predicted" in why
    packed = place({f"h{i}": [f"w{i}{j}" for j in range(4)] for i in range(4)}, 16)
    assert algorithms.choose(packed, 1e8, AverageConfig(fan_in=4))[0] == \
        "hierarchical"


def test_the_model_counts_bytes_per_link_like_the_graph():
    net = cost.Link(bandwidth=1e9, latency=0.0)
    L = 1e9
    # one replica per host: each phase moves L (p-1)/p over every link
    assert cost.sharded_allreduce_time(L, 8, net) == pytest.approx(2 * L * 7 / 8 / 1e9)
    assert cost.hierarchical_allreduce_time(L, 8, net) == \
        pytest.approx(cost.sharded_allreduce_time(L, 8, net))
    # four replicas per host: flat sharding moves 4x the bytes, hierarchical one float64
    # partial (2L) plus one copy (L) per host and phase
    flat = cost.sharded_allreduce_time(L, 16, net, hosts=4)
    local = cost.hierarchical_allreduce_time(L, 16, net, hosts=4, fan_in=4)
    assert flat == pytest.approx(2 * 4 * L * 3 / 4 / 1e9)
    assert local == pytest.approx((2 + 1) * L * 3 / 4 / 1e9)
    # the binomial tree: two levels of fan-in 2 then log2(4) copies, one per host
    tree = cost.tree_allreduce_time(L, 4, net, fan_in=2, broadcast="binomial", hosts=4)
    assert tree == pytest.approx((L + 2 * L + 2 * L) / 1e9)


# ---- training ---------------------------------------------------------------------------------

def _train_config(**changes):
    from pipeline import Config
    base = {"data.source": "synthetic:192:32", "model.name": "small-cnn",
            "train.batch_size": 16, "train.epochs": 1, "augment.policy": "cifar",
            "progress": False, "checkpoint_every": 0, "seed": 4, "train.replicas": 4,
            "average.fan_in": 2}
    return Config().replace(**{**base, **changes})


def _fake_hosts(client, resources=None):
    """The in-process workers seen as three hosts (2 + 1 + 1), as on a cluster."""
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    return {"10.0.0.1": workers[:2], "10.0.0.2": workers[2:3], "10.0.0.3": workers[3:]}


@pytest.fixture(scope="module")
def process_client():
    """Worker processes: in-process (threaded) workers do not give reproducible weights."""
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        yield c


@pytest.mark.slow
def test_training_on_hosts_gives_the_weights_of_the_tree_on_one_host(process_client,
                                                                      monkeypatch):
    """ipm with DiLoCo's outer step: the mean on replica 0's worker (reduce), the outer step
    there, the new parameters sent to every host (broadcast), the first round's parameters
    scattered the same way."""
    from pipeline.training.loop import train
    cfg = _train_config(**{"train.strategy": "ipm", "average.mix_every": "2",
                           "average.outer_lr": 0.8, "average.outer_momentum": 0.5})
    reference = train(cfg, client=process_client, log=lambda m: None)
    monkeypatch.setattr(algorithms, "workers_by_host", _fake_hosts)
    logs = []
    out = train(cfg.replace(**{"average.algorithm": "hierarchical"}), client=process_client,
                log=logs.append)
    assert same_bits(out.params, reference.params)
    assert "average: hierarchical, 4 replica(s) on 3 host(s), 3 shard(s)" in logs


@pytest.mark.slow
@pytest.mark.parametrize("strategy, changes, algorithm", [
    ("gradient", {"train.optimizer": "momentum"}, "sharded"),
    ("mixture", {"eval_every": 1}, "hierarchical"),
    ("ipm", {"train.optimizer": "adam", "average.optimizer_state": "average",
             "checkpoint_every": 1}, "sharded"),
], ids=["gradient", "mixture", "ipm-adam-averaged-state"])
def test_every_averaging_strategy_on_hosts_gives_the_weights_of_one_host(
        process_client, monkeypatch, tmp_path, strategy, changes, algorithm):
    """Each strategy's averages through the seam: gradient's mean and broadcast of the update,
    mixture's mid-run model and final allreduce, ipm's packed optimizer state (``prepare``) and
    its broadcast after every checkpoint's scatter."""
    from pipeline.training.loop import train
    cfg = _train_config(**{"train.strategy": strategy, "average.mix_every": "2", **changes})
    if cfg.checkpoint_every:
        cfg = cfg.replace(out=str(tmp_path / "one"))
    reference = train(cfg, client=process_client, log=lambda m: None)
    monkeypatch.setattr(algorithms, "workers_by_host", _fake_hosts)
    logs = []
    moved = cfg.replace(**{"average.algorithm": algorithm}, **(
        {"out": str(tmp_path / "hosts")} if cfg.checkpoint_every else {}))
    out = train(moved, client=process_client, log=logs.append)
    assert same_bits(out.params, reference.params)
    accuracy = [h.get("test_acc") for h in reference.history]
    assert [h.get("test_acc") for h in out.history] == accuracy
    assert any(line.startswith(f"average: {algorithm}, 4 replica(s) on 3 host(s)")
               for line in logs), logs
