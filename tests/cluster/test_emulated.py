"""Emulated hosts (pipeline.cluster.emulated): links capped by tbf, nothing left behind after a run, a
failed run or a killed owner; ipm trained across three emulated hosts gives the weights of a
one-worker run, byte for byte. Needs root and iproute2; elsewhere skipped with one line, except
under CI (.ci/run installs iproute2 and runs as root), where a missing piece fails."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pipeline.cluster import emulated
from tests.clusters import REPO
from tests.helpers import assert_same_bits, saved_weights

pytestmark = [pytest.mark.cluster]


def _skip_reason():
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return None
    return emulated.skip_reason()


@pytest.fixture(scope="module", autouse=True)
def _needs_namespaces():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


SEND = """
import socket, sys, time
host, n = sys.argv[1], int(sys.argv[2])
s = socket.create_connection((host, 5001), timeout=30)
block = bytes(1 << 16)
start = time.perf_counter()
for _ in range(n // len(block)):
    s.sendall(block)
s.shutdown(socket.SHUT_WR)
s.recv(1)
print(time.perf_counter() - start)
"""
RECEIVE = """
import socket
srv = socket.create_server(("0.0.0.0", 5001))
print("listening", flush=True)
conn, _ = srv.accept()
while conn.recv(1 << 20):
    pass
conn.close()
"""


def test_links_are_capped_and_nothing_is_left_behind():
    n_bytes = 5_000_000
    with emulated.emulated_cluster(2, "20mbit", workers_per_host=0) as c:
        receiver = subprocess.Popen(c.in_namespace(c.hosts[1], [sys.executable, "-c", RECEIVE]),
                                    env=c.env(), stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout.readline().strip() == "listening"  # its socket is bound
            sent = subprocess.run(c.in_namespace(c.hosts[0], [
                sys.executable, "-c", SEND, c.host_addresses[1], str(n_bytes)]),
                env=c.env(), capture_output=True, text=True, timeout=60)
        finally:
            receiver.wait(timeout=30)
        assert sent.returncode == 0, sent.stderr
        seconds = float(sent.stdout)
        assert len(emulated.list_namespaces()) >= 4  # switch, head, two hosts
        run = c.run
    rate = n_bytes * 8 / seconds
    assert 0.75 * 20e6 < rate < 1.05 * 20e6, f"{rate / 1e6:.1f} Mb/s through a 20 Mb/s link"
    assert emulated.leftovers(run) == []


def test_a_failing_run_and_a_killed_owner_leave_nothing_behind():
    with pytest.raises(KeyError):
        with emulated.emulated_cluster(1, workers_per_host=0) as c:
            run = c.run
            raise KeyError("boom")
    assert emulated.leftovers(run) == []
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pipeline import emulated\n"
         "with emulated.emulated_cluster(1, workers_per_host=1) as c:\n"
         "    print(c.run, flush=True); time.sleep(600)\n"],
        cwd=REPO, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    run = owner.stdout.readline().strip()
    assert run.startswith(emulated.FAMILY) and emulated.leftovers(run)
    owner.send_signal(signal.SIGKILL)  # no finally, no atexit: the next run must clean up
    owner.wait()
    assert run in emulated.cleanup_stale()
    deadline = time.monotonic() + 10
    while emulated.leftovers(run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert emulated.leftovers(run) == []


ARGS = ["--data", "synthetic:256:64", "--model", "small-cnn", "--strategy", "ipm", "--replicas",
        "4", "--mix-every", "2", "--epochs", "1", "--batch-size", "16", "--augment", "cifar",
        "--seed", "5", "--fan-in", "2", "--no-progress"]


@pytest.mark.slow
def test_ipm_across_three_hosts_gives_the_weights_of_one_worker(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    one = subprocess.run([sys.executable, "-m", "pipeline", "train", *ARGS, "--workers", "1",
                          "--out", str(tmp_path / "one")], capture_output=True, text=True,
                         timeout=300, env=env, cwd=REPO)
    assert one.returncode == 0, one.stderr
    reference = saved_weights(tmp_path / "one")
    with emulated.emulated_cluster(3, "100mbit", workers_per_host=(2, 1, 1),
                                   resources={"CPU": 1}) as c:
        runs = {name: c.run_in_head([sys.executable, "-m", "pipeline", "train", *ARGS,
                                     "--scheduler", c.scheduler_address, "--average", name,
                                     "--out", str(tmp_path / name)], timeout=300, cwd=REPO)
                for name in ("sharded", "hierarchical")}
        run = c.run
    assert emulated.leftovers(run) == []
    for name, done in runs.items():
        assert done.returncode == 0, done.stderr
        assert f"average: {name}, 4 replica(s) on 3 host(s)" in done.stderr
        weights = saved_weights(tmp_path / name)
        assert_same_bits(weights, reference, name)
    summary = json.loads((tmp_path / "sharded" / "summary.json").read_text())
    assert summary["rounds"] == 2
