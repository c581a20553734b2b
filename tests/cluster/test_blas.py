"""BLAS kernels across workers (pipeline.cluster.blas): one warning line where they differ, and
a pin that makes an external cluster's workers run one kernel."""
import os
import platform

import distributed
import pytest

from pipeline.cluster import blas
from pipeline.core.errors import ClusterError
from tests.clusters import subprocess_cluster

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(platform.machine() != "x86_64",
                                 reason="the kernels named here are OpenBLAS's x86-64 ones")]
# two kinds of machine: OpenBLAS's kernel and oneDNN's instruction set of each
MIXED = [blas.pinned_environ("Haswell"), blas.pinned_environ("Sandybridge")]


def test_mixed_kernels_warn_in_one_line_then_the_pin_runs_one():
    with subprocess_cluster(2, worker_env=MIXED) as cluster, \
            distributed.Client(cluster.address, timeout=30) as client:
        log = []
        before = blas.check(client, None, log.append, restart=False)
        assert sorted(b.kernel for b in before.values()) == ["Haswell", "Sandybridge"]
        assert len(log) == 1 and "\n" not in log[0]
        assert log[0].startswith("warning: the workers run different BLAS (")
        assert "Haswell, openblas" in log[0] and "Sandybridge, openblas" in log[0]
        assert "--blas-kernel KERNEL" in log[0]
        log.clear()
        after = blas.check(client, "Sandybridge", log.append, restart=True)
        assert {b.kernel for b in after.values()} == {"Sandybridge"} and len(after) == 2
        assert log == []


def test_a_worker_without_a_nanny_cannot_be_pinned():
    with subprocess_cluster(2, worker_env=MIXED, nanny=False) as cluster, \
            distributed.Client(cluster.address, timeout=30) as client:
        with pytest.raises(ClusterError, match="run without a nanny") as err:
            blas.check(client, "Haswell", lambda line: None, restart=True)
    assert "\n" not in str(err.value) and f"{blas.ENV}=Haswell" in str(err.value)


def test_the_local_cluster_starts_its_workers_with_the_kernel():
    from pipeline.cluster.connection import connect
    from pipeline.core.config import ClusterConfig
    cfg = ClusterConfig(workers=2, blas_kernel="Sandybridge", dashboard_address="127.0.0.1:0")
    before = {name: os.environ.get(name) for name in (blas.ENV, blas.ONEDNN_ENV)}
    with connect(cfg, log=lambda line: None) as client:
        log = []
        got = blas.check(client, cfg.blas_kernel, log.append, restart=True)
        client.restart()  # a nanny sets the variable again as it respawns its worker
        assert {b.kernel for b in blas.survey(client).values()} == {"Sandybridge"}
        isa = client.run(lambda: os.environ.get(blas.ONEDNN_ENV))  # oneDNN's set pinned with it
        assert set(isa.values()) == {"AVX"}, isa
    assert {b.kernel for b in got.values()} == {"Sandybridge"} and len(got) == 2 and log == []
    # The nannies ran in this process: what they set for their workers is not left behind here,
    # where every process started later (another cluster, a subprocess) would inherit it.
    assert {name: os.environ.get(name) for name in before} == before


@pytest.mark.parametrize("kernel", ["", "Haswell; rm -rf /", "x" * 40, "9lives"])
def test_a_kernel_that_is_not_a_name_is_refused_by_the_config(kernel):
    from pipeline.core.config import ClusterConfig
    with pytest.raises(ValueError, match="cluster.blas_kernel must be an OpenBLAS kernel name"):
        ClusterConfig(blas_kernel=kernel).validate()


def _tiny(address: str, **changes):
    from tests.helpers import make_config
    base = {"data.source": "synthetic:128:32", "model.name": "small-cnn", "train.batch_size": 16,
            "train.epochs": 1, "train.strategy": "ipm", "train.replicas": 2,
            "average.mix_every": "2", "augment.policy": "cifar", "progress": False,
            "checkpoint_every": 0, "eval_every": 0, "cluster.scheduler": address}
    return make_config(base, **changes)


def test_a_mixed_cluster_warns_once_and_the_pin_gives_the_one_kernel_answer():
    from pipeline import train
    from tests.helpers import assert_same_bits
    with subprocess_cluster(2, worker_env=MIXED) as mixed:
        log = []
        train(_tiny(mixed.address), log=log.append)
        warned = [line for line in log if line.startswith("warning: the workers run different")]
        assert len(warned) == 1, log
        log.clear()
        pinned = train(_tiny(mixed.address, **{"cluster.blas_kernel": "Sandybridge"}),
                       log=log.append).params
        assert not [line for line in log if line.startswith("warning:")], log
    with subprocess_cluster(2, env=blas.pinned_environ("Sandybridge")) as one_kind:
        assert_same_bits(pinned, train(_tiny(one_kind.address), log=lambda line: None).params)


def test_a_bf16_run_on_workers_with_different_bf16_instructions_warns_in_one_line(monkeypatch):
    """Each worker reports its own flags (fed here: one AMX machine, one AVX512-BF16 only);
    an fp32 run says nothing of them."""
    from pipeline.core import precision
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address="127.0.0.1:0") as cluster, \
            distributed.Client(cluster) as client:
        first = sorted(client.scheduler_info()["workers"])[0]
        monkeypatch.setattr(precision, "cpu_flags", lambda dask_worker: (
            {"avx512f", "amx_bf16", "avx512_bf16"} if dask_worker.address == first
            else {"avx512f", "avx512_bf16"}))
        log = []
        blas.check(client, None, log.append, restart=False, precision="fp32")
        assert log == []
        blas.check(client, None, log.append, restart=False, precision="bf16")
    assert len(log) == 1 and "\n" not in log[0]
    assert log[0].startswith("warning: --precision bf16 on workers with different bf16 "
                             f"instructions (amx_bf16 on {first}; avx512_bf16 on ")
