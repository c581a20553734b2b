"""BLAS kernels across workers (pipeline.cluster.blas): one warning line where they differ, and
a pin that makes an external cluster's workers run one kernel."""
import platform

import distributed
import pytest

from pipeline.cluster import blas
from pipeline.core.errors import ClusterError
from tests.clusters import subprocess_cluster

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(platform.machine() != "x86_64",
                                 reason="the kernels named here are OpenBLAS's x86-64 ones")]
MIXED = [{blas.ENV: "Haswell"}, {blas.ENV: "Sandybridge"}]


def test_mixed_kernels_warn_in_one_line_then_the_pin_runs_one():
    with subprocess_cluster(2, worker_env=MIXED) as cluster, \
            distributed.Client(cluster.address, timeout=30) as client:
        log = []
        before = blas.check(client, None, log.append, restart=False)
        assert sorted(b.kernel for b in before.values()) == ["Haswell", "Sandybridge"]
        assert len(log) == 1 and "\n" not in log[0]
        assert log[0].startswith("warning: the workers run different BLAS (Haswell, ")
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
