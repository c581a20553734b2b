"""Tests for pipeline.cluster.connection: embedded and external clusters, resources, fail-fast errors and TLS."""
from __future__ import annotations

import pickle
import time

import distributed
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cluster import connection as cluster
from pipeline.core.config import ClusterConfig
from pipeline.core.errors import ClusterError
from tests.clusters import free_port, make_tls, subprocess_cluster


def _tls_cfg(files, **kw) -> ClusterConfig:
    return ClusterConfig(tls_ca_file=files.ca_file, tls_cert=files.cert, tls_key=files.key, **kw)


def _add(a, b):
    return a + b


# --- pure parts -------------------------------------------------------------------------------


def test_security_none_without_tls_files():
    assert cluster.security_from(ClusterConfig()) is None


def test_security_requires_encryption(tmp_path):
    files = make_tls(tmp_path)["client"]
    sec = cluster.security_from(_tls_cfg(files))
    assert sec.require_encryption
    assert (sec.tls_ca_file, sec.tls_client_cert, sec.tls_client_key) == files


@pytest.mark.parametrize("field", ["tls_ca_file", "tls_cert", "tls_key"])
def test_security_names_the_missing_file(tmp_path, field):
    files = make_tls(tmp_path)["client"]
    cfg = _tls_cfg(files).__class__(**{**_tls_cfg(files).__dict__, field: str(tmp_path / "gone.pem")})
    with pytest.raises(ClusterError, match=rf"cluster\.{field} .*no such file '.*gone\.pem'"):
        cluster.security_from(cfg)


def test_security_needs_all_three_files(tmp_path):
    files = make_tls(tmp_path)["client"]
    with pytest.raises(ClusterError, match=r"cluster\.tls_key \(--tls-key\) is required"):
        cluster.security_from(ClusterConfig(tls_ca_file=files.ca_file, tls_cert=files.cert))


def test_tls_without_scheduler_is_refused(tmp_path):
    files = make_tls(tmp_path)["client"]
    with pytest.raises(ClusterError, match="need --scheduler tls://"):
        with cluster.connect(_tls_cfg(files)):
            pass


def test_tls_address_without_files_is_refused_at_once():
    start = time.monotonic()
    with pytest.raises(ClusterError, match="uses TLS: give --tls-ca-file"):
        with cluster.connect(ClusterConfig(scheduler="tls://127.0.0.1:1")):
            pass
    assert time.monotonic() - start < 1


def test_scheduler_address_from_environment(monkeypatch):
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "tcp://127.0.0.1:9999")
    assert cluster.scheduler_address(ClusterConfig()) == "tcp://127.0.0.1:9999"
    assert cluster.scheduler_address(ClusterConfig(scheduler="tcp://h:1")) == "tcp://h:1"
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS")
    assert cluster.scheduler_address(ClusterConfig()) is None


@settings(max_examples=50, deadline=None, derandomize=True)
@given(host=st.from_regex(r"[a-z0-9.]{1,20}", fullmatch=True), port=st.integers(1, 65535))
def test_bare_address_becomes_tls_under_tls(host, port):
    sec = distributed.security.Security(require_encryption=True)
    assert cluster._with_protocol(f"{host}:{port}", sec) == f"tls://{host}:{port}"
    assert cluster._with_protocol(f"tls://{host}:{port}", sec) == f"tls://{host}:{port}"
    with pytest.raises(ClusterError, match="is not tls://"):
        cluster._with_protocol(f"tcp://{host}:{port}", sec)


def test_worker_threads_outside_a_worker_is_the_usable_cores():
    assert 1 <= cluster.worker_threads() <= (psutil.cpu_count() or 1)


def test_task_functions_pickle():
    for fn in (cluster.worker_threads, cluster.limit_blas_threads):
        assert pickle.loads(pickle.dumps(fn)) is fn


def test_limit_blas_threads_caps_the_pools():
    from threadpoolctl import threadpool_info
    with cluster.limit_blas_threads(1) as n:
        assert n == 1
        assert all(pool["num_threads"] == 1 for pool in threadpool_info())


# --- embedded LocalCluster --------------------------------------------------------------------


def _children() -> set[int]:
    """Our child processes, less multiprocessing's resource tracker (it lives as long as we do)."""
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())}


def test_local_cluster_sized_logged_and_closed_cleanly(capfd):
    lines = []
    before = _children()
    with cluster.connect(ClusterConfig(workers=2, threads_per_worker=1), log=lines.append) as client:
        info = cluster.describe(client)
        threads = client.gather(client.map(lambda i: cluster.worker_threads(), range(4), pure=False))
        quiet = client.run(_quiet_on_close)
        start = time.monotonic()
        with pytest.raises(ClusterError, match=r"'GPU'.*workers advertise: tcp://127\.0\.0\.1:\d+ CPU=1"):
            cluster.require_resource(client, "GPU", timeout=30)
        assert time.monotonic() - start < 5  # an own LocalCluster gains no workers: no 30 s wait
        cluster.require_resource(client, "CPU", timeout=0)
    assert (info["workers"], info["threads"], info["resources"]) == (2, 2, {"CPU": 2})
    assert info["dashboard"].startswith("http://127.0.0.1:")
    assert threads == [1, 1, 1, 1]
    assert list(quiet.values()) == [True, True]  # the preload ran in each worker process
    assert len(lines) == 1 and info["dashboard"] in lines[0] and "2 workers" in lines[0]
    leftover = _children() - before
    assert not leftover, f"processes left behind: {leftover}"
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err


def _quiet_on_close(dask_worker) -> bool:
    import logging
    from pipeline.cluster.worker_setup import ClosingHeartbeatFilter
    log = logging.getLogger("distributed.worker")
    return any(isinstance(f, ClosingHeartbeatFilter) and dask_worker in f._workers
               for f in log.filters)


def test_the_local_cluster_runs_quiet_housekeeping_a_users_setting_stays():
    """Our own cluster samples and ticks less often (embedded.QUIET): its scheduler and workers
    run with those values, except one the user set; this process's config is left as it was."""
    import dask
    from pipeline.cluster import embedded
    mine, before = "50ms", dask.config.get("distributed.admin.tick.interval")
    with dask.config.set({"distributed.worker.profile.interval": mine}), \
            cluster.connect(ClusterConfig(workers=2, threads_per_worker=1),
                            log=lambda line: None) as client:
        on_workers = client.run(_config_of, list(embedded.QUIET))
        ticks = client.run_on_scheduler(_scheduler_tick_s)
        after = dask.config.get("distributed.admin.tick.interval")
    expected = {**embedded.QUIET, "distributed.worker.profile.interval": mine}
    assert list(on_workers.values()) == [expected, expected]
    assert ticks == 1.0 and after == before


def _config_of(keys: list) -> dict:
    import dask
    return {key: dask.config.get(key) for key in keys}


def _scheduler_tick_s(dask_scheduler) -> float:
    return dask_scheduler.periodic_callbacks["tick"].callback_time / 1000


def test_default_workers_fill_the_cores():
    from dask.system import CPU_COUNT
    assert cluster.default_workers(1) == CPU_COUNT
    assert cluster.default_workers(CPU_COUNT + 1) == 1
    assert cluster.default_workers(1, gpu_workers=1) == max(1, CPU_COUNT - 1)


@pytest.mark.parametrize("visible, expected", [("0,2", ["0", "2"]), ("", []), ("-1", []),
                                               ("GPU-1a2b, 1", ["GPU-1a2b", "1"])])
def test_local_gpus_follow_cuda_visible_devices(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert cluster.local_gpus() == expected


def test_local_gpus_from_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cluster.local_gpus() == []  # no nvidia-smi at all
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-a)'\n"
                    "echo 'GPU 1: NVIDIA H100 (UUID: GPU-b)'\necho '  MIG 1g.10gb Device 0'\n")
    fake.chmod(0o755)
    assert cluster.local_gpus() == ["0", "1"]


def _visible_devices():
    import os
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_embedded_gpu_workers_advertise_gpu_and_see_one_device():
    # No GPU is touched: the worker only advertises GPU=1 and gets CUDA_VISIBLE_DEVICES=3.
    with cluster.connect(ClusterConfig(workers=1), log=lambda line: None, gpus=["3"]) as client:
        info = cluster.describe(client)
        seen = client.submit(_visible_devices, resources={"GPU": 1}, pure=False).result(timeout=10)
        cpu_seen = client.submit(_visible_devices, resources={"CPU": 1}, pure=False).result(timeout=10)
        quiet = client.run(_quiet_on_close)
        cluster.require_resource(client, "GPU", timeout=0)
        with pytest.raises(ClusterError, match=r"the local cluster has no worker with resource "
                                               r"'TPU' \(its workers advertise: ") as err:
            cluster.require_resource(client, "TPU", timeout=30)  # embedded: no waiting
    assert "waited" not in str(err.value) and "dask worker" not in str(err.value)
    assert (info["workers"], info["threads"], info["resources"]) == (2, 2, {"CPU": 1, "GPU": 1})
    # Beside a CPU worker the GPU worker is a rank: replicas are held to it by RANK-0.
    assert sorted(map(sorted, (w["resources"] for w in info["per_worker"].values()))) == [
        ["CPU"], ["GPU", "RANK-0"]] and info["ranks"] == 1
    assert info["dashboard"].startswith("http://127.0.0.1:")
    assert seen == "3" and cpu_seen != "3"
    assert list(quiet.values()) == [True, True]


# --- external scheduler: real `dask scheduler` + `dask worker` processes ----------------------


@pytest.fixture(scope="module")
def cpu_gpu_cluster():
    with subprocess_cluster(n_workers=2, resources=[{"CPU": 1}, {"GPU": 1}]) as c:
        yield c


@pytest.mark.cluster
def test_connect_external_and_describe(cpu_gpu_cluster):
    lines = []
    cfg = ClusterConfig(scheduler=cpu_gpu_cluster.address)
    with cluster.connect(cfg, log=lines.append) as client:
        assert client.submit(_add, 1, 2).result(timeout=10) == 3
        info = cluster.describe(client)
        assert cluster.has_resource(client, "CPU") and cluster.has_resource(client, "GPU")
        assert not cluster.has_resource(client, "TPU")
        by_worker = cluster.worker_resources(client)
    assert info["scheduler"] == cpu_gpu_cluster.address
    assert (info["workers"], info["threads"], info["resources"]) == (2, 2, {"CPU": 1, "GPU": 1})
    assert sorted(map(dict, by_worker.values()), key=str) == [{"CPU": 1}, {"GPU": 1}]
    assert lines == [f"connected to {cpu_gpu_cluster.address}: 2 workers, 2 threads, "
                     f"resources CPU=1 GPU=1; dashboard {info['dashboard']}"]


@pytest.mark.cluster
def test_connect_from_environment_variable(cpu_gpu_cluster, monkeypatch):
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", cpu_gpu_cluster.address)
    with cluster.connect(ClusterConfig()) as client:
        assert client.scheduler.address == cpu_gpu_cluster.address
        assert client.cluster is None  # no LocalCluster was started


@pytest.mark.cluster
def test_resource_annotated_task_runs_on_the_advertising_worker(cpu_gpu_cluster):
    with cluster.connect(ClusterConfig(scheduler=cpu_gpu_cluster.address)) as client:
        cluster.require_resource(client, "GPU", timeout=5)
        gpu_worker = next(a for a, r in cluster.worker_resources(client).items() if "GPU" in r)
        where = client.gather([client.submit(lambda i: distributed.get_worker().address, i,
                                             resources={"GPU": 1}, pure=False) for i in range(4)])
        threads = client.submit(cluster.worker_threads, pure=False).result(timeout=10)
    assert set(where) == {gpu_worker}
    assert threads == 1


@pytest.mark.cluster
def test_missing_resource_fails_fast_naming_what_workers_have(cpu_gpu_cluster):
    with cluster.connect(ClusterConfig(scheduler=cpu_gpu_cluster.address)) as client:
        start = time.monotonic()
        with pytest.raises(ClusterError) as info:
            cluster.require_resource(client, "TPU", timeout=1.0)
        elapsed = time.monotonic() - start
    message = str(info.value)
    assert 1.0 <= elapsed < 4.0  # the bound plus slack for a loaded CI machine
    assert "no worker advertises resource 'TPU' (waited 1 s)" in message
    assert "CPU=1" in message and "GPU=1" in message and "--resources TPU=1" in message
    assert "\n" not in message


@pytest.mark.cluster
def test_unreachable_scheduler_fails_after_the_bounded_timeout():
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ClusterError, match=rf"cannot reach scheduler at {address} within 2 s: "):
        with cluster.connect(ClusterConfig(scheduler=address, connect_timeout=2)):
            pass
    assert time.monotonic() - start < 5


@pytest.mark.cluster
def test_scheduler_without_workers_fails_after_the_bounded_timeout():
    with subprocess_cluster(n_workers=0, dashboard=False) as c:
        start = time.monotonic()
        with pytest.raises(ClusterError, match=r"has 0 workers, needs 1 \(waited 1 s\)"):
            with cluster.connect(ClusterConfig(scheduler=c.address, connect_timeout=1)):
                pass
        assert time.monotonic() - start < 4


# --- TLS --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    files = make_tls(tmp_path_factory.mktemp("tls"))
    with subprocess_cluster(n_workers=1, resources={"CPU": 1}, tls=files) as c:
        yield c


@pytest.mark.cluster
def test_tls_cluster_computes_for_a_client_with_the_certificate(tls_cluster):
    assert tls_cluster.address.startswith("tls://127.0.0.1:")
    cfg = _tls_cfg(tls_cluster.tls["client"], scheduler=tls_cluster.address)
    with cluster.connect(cfg) as client:
        assert client.submit(_add, 20, 22).result(timeout=10) == 42
        assert cluster.describe(client)["resources"] == {"CPU": 1}
    bare = tls_cluster.address.removeprefix("tls://")  # HOST:PORT defaults to tls:// under TLS
    with cluster.connect(_tls_cfg(tls_cluster.tls["client"], scheduler=bare)) as client:
        assert client.submit(_add, 1, 1).result(timeout=10) == 2


def _refused(tls_cluster, cfg: ClusterConfig, match: str) -> None:
    """connect(cfg) fails with ClusterError well inside its bound and the scheduler logs a refusal."""
    refusals = tls_cluster.logs(tail=10**6).count("TLS handshake failed")
    start = time.monotonic()
    with pytest.raises(ClusterError, match=match):
        with cluster.connect(cfg):
            pass
    assert time.monotonic() - start < cfg.connect_timeout + 3
    deadline = time.monotonic() + 5  # the scheduler's log line may trail the client's error
    while tls_cluster.logs(tail=10**6).count("TLS handshake failed") == refusals:
        assert time.monotonic() < deadline, tls_cluster.logs()
        time.sleep(0.05)


@pytest.mark.cluster
def test_tls_cluster_refuses_a_plain_tcp_client(tls_cluster):
    address = tls_cluster.address.replace("tls://", "tcp://")
    _refused(tls_cluster, ClusterConfig(scheduler=address, connect_timeout=2),
             rf"cannot reach scheduler at {address} within 2 s: ")


@pytest.mark.cluster
def test_tls_cluster_refuses_a_client_certificate_from_another_ca(tls_cluster, tmp_path):
    # The client trusts the cluster's CA, but its own certificate was signed by a stranger.
    stranger = make_tls(tmp_path, roles=("client",), ca_name="stranger-ca")["client"]
    cfg = ClusterConfig(scheduler=tls_cluster.address, connect_timeout=2,
                        tls_ca_file=tls_cluster.tls["client"].ca_file, tls_cert=stranger.cert,
                        tls_key=stranger.key)
    _refused(tls_cluster, cfg, r"cannot reach scheduler at tls://127\.0\.0\.1:\d+ within 2 s: ")


@pytest.mark.cluster
def test_tls_client_refuses_a_scheduler_from_an_unknown_ca(tls_cluster, tmp_path):
    stranger = make_tls(tmp_path, roles=("client",), ca_name="stranger-ca")["client"]
    _refused(tls_cluster, _tls_cfg(stranger, scheduler=tls_cluster.address, connect_timeout=2),
             "within 2 s: TLS certificate does not match")


def test_auto_threads_give_one_replica_all_the_cores_and_several_one_thread_workers():
    """Left open, --threads-per-worker is 1 (a replica per one-thread worker) except for one
    replica on a CPU-only local cluster with our kernels: one worker with every core."""
    from dask.system import CPU_COUNT

    from pipeline.cluster.embedded import threads_per_worker
    auto = ClusterConfig()
    assert threads_per_worker(auto, 1, "ours") == CPU_COUNT
    assert threads_per_worker(auto, 2, "ours") == 1
    assert threads_per_worker(auto, 1, "chainer") == 1  # BLAS threads would change its bits
    assert threads_per_worker(auto, 1, "ours", gpus=["0"]) == 1
    for given in ({"workers": 2}, {"loader_workers": 1}, {"scheduler": "tcp://127.0.0.1:1"}):
        assert threads_per_worker(ClusterConfig(**given), 1, "ours") == 1, given
    assert threads_per_worker(ClusterConfig(threads_per_worker=1), 1, "ours") == 1
