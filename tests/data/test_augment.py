"""The augment- stage on Dask: same bytes on 1 and 2 workers (threads and processes), key names, resource steering."""
from __future__ import annotations

import pickle

import dask
import dask.array as da
from dask.base import collections_to_expr
import numpy as np
import pytest
from distributed import Client, LocalCluster, Scheduler, SpecCluster, Worker, get_task_stream
from distributed.utils import key_split

import augment
from pipeline.data.augment import AugmentTask, augment_array, augment_chunk, augment_rng, cpu_resources
from pipeline.core.rng import rng_for

SEED, EPOCH, CHUNK = 3, 2, 64
POLICY = augment.get_policy("cifar-cutout")


@pytest.fixture(scope="module")
def raw() -> np.ndarray:
    """(300, 3, 32, 32) uint8, seeded; 300 = 4 full chunks of 64 and one of 44."""
    return np.random.default_rng(0).integers(0, 256, (300, 3, 32, 32), dtype=np.uint8)


@pytest.fixture(scope="module")
def expected(raw) -> np.ndarray:
    """The augmentation every cluster must reproduce, from position-keyed params on the host."""
    params = augment.sample_for_positions(POLICY, augment_rng(SEED, EPOCH), np.arange(len(raw)),
                                          CHUNK)
    return POLICY.apply(raw, params)


def _images(raw, chunks=100):
    return da.from_array(raw, chunks=(chunks, 3, 32, 32))


def _local(n_workers, processes=False, **kwargs):
    return LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=processes,
                        dashboard_address=":0", **kwargs)


def test_matches_host_params_on_the_sync_scheduler(raw, expected):
    out = augment_array(_images(raw), POLICY, SEED, EPOCH, CHUNK)
    assert out.chunks[0] == (64, 64, 64, 64, 44) and out.dtype == np.uint8
    np.testing.assert_array_equal(out.compute(scheduler="sync"), expected)


def test_chunk_plan_is_by_global_index_not_input_chunks(raw, expected):
    for chunks in (7, 64, 300):
        out = augment_array(_images(raw, chunks), POLICY, SEED, EPOCH, CHUNK)
        np.testing.assert_array_equal(out.compute(scheduler="threads"), expected)


def test_same_bytes_on_one_and_two_workers(raw, expected):
    results = []
    for n in (1, 2):
        with _local(n) as cluster, Client(cluster) as client:
            results.append(client.compute(augment_array(_images(raw), POLICY, SEED, EPOCH, CHUNK)).result())
    for result in results:
        assert result.tobytes() == expected.tobytes()


@pytest.mark.cluster
def test_same_bytes_in_worker_processes(raw, expected):
    with _local(2, processes=True) as cluster, Client(cluster) as client:
        out = client.compute(augment_array(_images(raw), POLICY, SEED, EPOCH, CHUNK)).result()
    assert out.tobytes() == expected.tobytes()


def test_epoch_and_seed_change_the_bytes(raw, expected):
    for seed, epoch in ((SEED, EPOCH + 1), (SEED + 1, EPOCH)):
        out = augment_array(_images(raw), POLICY, seed, epoch, CHUNK).compute(scheduler="sync")
        assert not np.array_equal(out, expected)


def test_keys_read_augment_with_epoch_and_chunk_in_the_tuple(raw):
    out = augment_array(_images(raw), POLICY, SEED, EPOCH, CHUNK)
    graph = dict(out.__dask_graph__())
    tasks = sorted(k for k in graph if isinstance(k, tuple) and k[0].startswith("augment-"))
    assert [k[1:] for k in tasks] == [(EPOCH, j) for j in range(5)]
    token = tasks[0][0].split("-", 1)[1]
    assert len(token) == 8 and int(token, 16) >= 0
    assert {key_split(k) for k in tasks} == {"augment"}
    again = augment_array(_images(raw), POLICY, SEED, EPOCH, CHUNK)
    assert again.name == out.name  # same inputs, same keys
    assert augment_array(_images(raw), POLICY, SEED, EPOCH + 1, CHUNK).name != out.name


def test_augment_keys_survive_optimization(raw):
    # Low-level fusion would rename them (e.g. "rechunk-merge-augment"); AugmentTask blocks it.
    out = augment_array(_images(raw, 7), POLICY, SEED, EPOCH, CHUNK)
    (optimized,) = dask.optimize(out)
    keys = [k for k in dict(optimized.__dask_graph__()) if isinstance(k, tuple)]
    assert sum(key_split(k) == "augment" for k in keys) == 5
    assert not any("augment" in key_split(k) and key_split(k) not in ("augment", "augmented")
                   for k in keys)


def test_task_stream_shows_augment_tasks(raw):
    with _local(2) as cluster, Client(cluster) as client:
        with get_task_stream(client) as stream:
            client.compute(augment_array(_images(raw), POLICY, SEED, EPOCH, CHUNK)).result()
    ran = [t["key"] for t in stream.data]
    assert sorted(k[1:] for k in ran if key_split(k) == "augment") == [(EPOCH, j) for j in range(5)]


def _steering_cluster():
    """Two in-process workers; only "cpu" advertises resources={"CPU": 1}."""
    workers = {"cpu": {"cls": Worker, "options": {"nthreads": 1, "resources": {"CPU": 1}}},
               "plain": {"cls": Worker, "options": {"nthreads": 1}}}
    return SpecCluster(workers=workers, scheduler={"cls": Scheduler,
                                                   "options": {"dashboard_address": ":0"}})


def test_resources_steer_augment_tasks_to_cpu_workers(raw, expected):
    with _steering_cluster() as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        resources = cpu_resources(client)
        assert resources == {"CPU": 1} and cpu_resources(client, "GPU") is None
        cpu = next(a for a, w in client.scheduler_info()["workers"].items() if w["resources"])
        with get_task_stream(client) as stream:
            out = client.compute(augment_array(_images(raw), POLICY, SEED, EPOCH, CHUNK,
                                               resources)).result()
    assert out.tobytes() == expected.tobytes()
    workers = {t["worker"] for t in stream.data if key_split(t["key"]) == "augment"}
    assert workers == {cpu}


def test_plain_local_cluster_has_no_cpu_resource_and_runs_anywhere(raw, expected):
    with _local(1) as cluster, Client(cluster) as client:
        assert cpu_resources(client) is None
        out = client.compute(augment_array(_images(raw), POLICY, SEED, EPOCH, CHUNK,
                                           cpu_resources(client))).result()
    assert out.tobytes() == expected.tobytes()


def test_task_functions_and_policies_pickle(raw):
    for obj in (augment_chunk, augment_array, augment_rng(SEED, EPOCH), POLICY, AugmentTask):
        assert pickle.loads(pickle.dumps(obj)) is not None
    rng = pickle.loads(pickle.dumps(augment_rng(SEED, EPOCH)))(3)
    assert rng.integers(1 << 30) == rng_for(SEED, "augment", EPOCH, 3).integers(1 << 30)
    task = dict(augment_array(_images(raw), POLICY, SEED, EPOCH, CHUNK).__dask_graph__())
    key = next(k for k in task if key_split(k) == "augment")
    clone = pickle.loads(pickle.dumps(task[key]))
    assert type(clone) is AugmentTask and clone.block_fusion


def test_last_short_chunk_uses_the_first_rows_of_its_sample(raw, expected):
    out = augment_chunk(raw[256:], POLICY, SEED, EPOCH, 4, CHUNK)
    np.testing.assert_array_equal(out, expected[256:])


@pytest.mark.parametrize("call, message", [
    (lambda x: augment_array(x.compute(), POLICY, 0, 0, 8), "images must be a dask array"),
    (lambda x: augment_array(x.astype(np.float32), POLICY, 0, 0, 8), "images must be a dask array"),
    (lambda x: augment_array(x, POLICY, 0, 0, 0), "augment.chunk must be >= 1, got 0"),
    (lambda x: augment_array(x, POLICY, -1, 0, 8), "seed and epoch must be >= 0"),
])
def test_bad_arguments_name_the_field(raw, call, message):
    with pytest.raises(ValueError, match=message):
        call(_images(raw[:10]))


def test_resources_survive_optimization_and_reach_only_augment_keys(raw):
    # What distributed reads: the annotations of the collection's optimized graph.
    out = augment_array(_images(raw, 7), POLICY, SEED, EPOCH, CHUNK, {"CPU": 1})
    (expr,) = collections_to_expr([out]).operands
    resources = {k: v for k, v in expr.__dask_annotations__()["resources"].items() if v is not None}
    assert {key_split(k) for k in resources} == {"augment"} and len(resources) == 5
    assert set(map(str, resources.values())) == {"{'CPU': 1}"}
    plain = augment_array(_images(raw, 7), POLICY, SEED, EPOCH, CHUNK)
    (expr,) = collections_to_expr([plain]).operands
    assert not any(expr.__dask_annotations__().get("resources", {}).values())
