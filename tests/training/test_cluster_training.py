"""Training through hand-started clusters, as docs/cluster.md tells users to start them: a real
`dask scheduler` and two `dask worker --resources CPU=1` processes, in plain TCP and in TLS, driven
by the CLI in its own process. Same seed, same weights as on an embedded LocalCluster."""
import subprocess

import pytest

from tests.clusters import make_tls, subprocess_cluster
from tests.helpers import assert_same_bits, run_cli, saved_weights

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ARGS = ["--data", "synthetic:256:64", "--model", "small-cnn", "--strategy", "ipm", "--replicas",
        "2", "--mix-every", "4", "--epochs", "1", "--batch-size", "16", "--augment", "cifar",
        "--seed", "5", "--no-progress"]


def _train(out, *extra) -> subprocess.CompletedProcess:
    return run_cli("train", *ARGS, "--out", str(out), *extra, timeout=240)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("embedded") / "run"
    done = _train(out, "--workers", "1")
    assert done.returncode == 0, done.stderr
    return saved_weights(out)


def test_train_through_scheduler_and_two_workers(tmp_path, reference):
    with subprocess_cluster(n_workers=2, resources={"CPU": 1}) as cluster:
        done = _train(tmp_path / "run", "--scheduler", cluster.address)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("done: ")
    weights = saved_weights(tmp_path / "run")
    assert_same_bits(weights, reference)


def test_train_through_tls_cluster(tmp_path, reference):
    files = make_tls(tmp_path / "tls")
    client = files["client"]
    with subprocess_cluster(n_workers=2, resources={"CPU": 1}, tls=files) as cluster:
        done = _train(tmp_path / "run", "--scheduler", cluster.address, "--tls-ca-file",
                      client.ca_file, "--tls-cert", client.cert, "--tls-key", client.key)
        refused = _train(tmp_path / "refused", "--scheduler",
                         cluster.address.replace("tls://", "tcp://"))
    assert done.returncode == 0, done.stderr
    weights = saved_weights(tmp_path / "run")
    assert_same_bits(weights, reference)
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0 and "cannot reach scheduler" in refused.stderr
    assert "Traceback" not in refused.stderr
