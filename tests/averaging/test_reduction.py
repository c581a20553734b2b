"""Tests for pipeline.averaging.reduction: the tree of average- tasks on an in-process cluster."""
import pickle
from functools import partial

import numpy as np
import pytest
from dask.utils import key_split
from distributed import Client, LocalCluster

from pipeline.averaging.exact import combine, finalize, leaf
from pipeline.averaging.exact import combine_finalize
from pipeline.averaging.reduction import _node, _root_fn, reduce_local, tree_plan, tree_reduce
from tests.helpers import make_states

TOKEN = "0a1b2c3d"


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        yield c


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("fan_in", [2, 3, 4])
def test_graph_result_is_bit_exact_mean(client, fan_in, fused):
    for k in range(1, 9):
        states = make_states(k, seed=100 * fan_in + k)
        futures = client.scatter(states)  # scatter in order: futures[i] is replica i
        root = tree_reduce(client, futures, combine, finalize, fan_in=fan_in,
                           token=TOKEN, coords=(fan_in, k, int(fused)),
                           combine_finalize=combine_finalize if fused else None)
        out = root.result()
        expected = finalize(combine(states))
        assert list(out) == list(expected)
        for key in expected:
            assert out[key].dtype == expected[key].dtype
            assert out[key].tobytes() == expected[key].tobytes(), (fan_in, k, key)
        assert int(out["/bn1/N"]) == 100  # replica 0's count, not a mean
        assert root.key == (f"average-{TOKEN}", fan_in, k, int(fused),
                            len(tree_plan(k, fan_in)) - 1, 0)


def test_float64_graph_equals_the_local_tree_bit_for_bit(client):
    states = make_states(7, seed=1, dtype=np.float64)
    root = tree_reduce(client, client.scatter(states), combine, finalize, fan_in=2,
                       token=TOKEN, coords=("f64",))
    local = reduce_local(states, combine, finalize, fan_in=2)
    for key, value in root.result().items():
        assert value.tobytes() == local[key].tobytes()


def test_weighted_leaf_is_fused_into_the_first_level(client):
    states = make_states(5, seed=2)
    weights = [1, 2, 3, 4, 5]
    pairs = client.scatter(list(zip(states, weights)))
    root = tree_reduce(client, pairs, combine, finalize, fan_in=2, token=TOKEN,
                       coords=("weighted",), leaf=lambda pair: leaf(*pair))
    expected = finalize(combine([leaf(s, w) for s, w in zip(states, weights)]))
    for key, value in root.result().items():
        assert value.tobytes() == expected[key].tobytes()


def test_keys_are_named_ordered_and_deterministic(client):
    states = client.scatter(make_states(5, seed=3))
    root = tree_reduce(client, states, combine, finalize, fan_in=2, token="deadbeef",
                       coords=(7, "x"))
    root.result()
    prefix = "average-deadbeef"
    # K=5, fan-in 2: (0,0)=[0,1], (0,1)=[2,3]; input 4 is handed up; (1,0); root (2,0)
    expected = {(prefix, 7, "x", 0, 0), (prefix, 7, "x", 0, 1), (prefix, 7, "x", 1, 0),
                (prefix, 7, "x", 2, 0)}
    assert root.key == (prefix, 7, "x", 2, 0)
    assert {key_split(k) for k in expected} == {"average"}
    again = tree_reduce(client, states, combine, finalize, fan_in=2, token="deadbeef",
                        coords=(7, "x"))
    assert again.key == root.key
    graph_keys = set(client.run_on_scheduler(
        lambda dask_scheduler: [k for k in dask_scheduler.tasks
                                if isinstance(k, tuple) and k[0] == "average-deadbeef"]))
    assert graph_keys <= expected and root.key in graph_keys


def test_children_are_grouped_by_index_not_completion(client):
    # the combine records the order it sees; inputs finish in reverse order
    def slow_identity(x, delay):
        import time
        time.sleep(delay)
        return x
    futures = [client.submit(slow_identity, [i], 0.02 * (4 - i), pure=False) for i in range(4)]
    root = tree_reduce(client, futures, lambda items: sum(items, []), lambda x: x, fan_in=2,
                       token=TOKEN, coords=("order",))
    assert root.result() == [0, 1, 2, 3]


def test_name_and_token_validation(client):
    with pytest.raises(ValueError, match="token"):
        tree_reduce(client, [1], combine, finalize, fan_in=2, token="abcdef")
    with pytest.raises(ValueError, match="fan_in"):
        tree_reduce(client, [1], combine, finalize, fan_in=1, token=TOKEN)
    with pytest.raises(ValueError, match="at least one"):
        tree_reduce(client, [], combine, finalize, fan_in=2, token=TOKEN)


def test_custom_name_shows_in_key_split(client):
    root = tree_reduce(client, [1, 2, 3], sum, lambda s: s, fan_in=2, name="average-grad",
                       token=TOKEN)
    assert root.result() == 6 and key_split(root.key) == "average-grad"


@pytest.mark.parametrize("n,fan_in", [(1, 2), (2, 2), (8, 2), (9, 3), (7, 4)])
def test_plan_covers_every_input_once_in_order(n, fan_in):
    levels = tree_plan(n, fan_in)
    assert [i for group in levels[0] for i in group] == list(range(n))
    assert len(levels[-1]) == 1
    for below, above in zip(levels, levels[1:]):
        assert [i for group in above for i in group] == list(range(len(below)))


def test_task_function_pickles():
    task = partial(_node, raw=(True, False), reduce=_root_fn(combine, finalize, None), leaf=leaf)
    again = pickle.loads(pickle.dumps(task))
    s = make_states(2, seed=4)
    out = again(s[0], leaf(s[1]))
    assert out["/conv1/W"].tobytes() == finalize(combine(s))["/conv1/W"].tobytes()
    assert pickle.loads(pickle.dumps(tree_reduce)) is tree_reduce
