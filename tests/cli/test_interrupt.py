"""Ctrl-C and SIGTERM with real processes: `python -m pipeline train` on its embedded cluster gets
the signal as a terminal (or a batch scheduler) sends it, to the whole process group; it stops at
a round boundary with a checkpoint and one line, exits 130 or 143, and `--resume` then finishes
with the weights of a run that was never interrupted, byte for byte.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.core import interrupt
from pipeline.cli.parser import build_parser
from pipeline.cli.commands import config_from_args
from pipeline.core.errors import Interrupted
from pipeline.training.loop import train
from tests.clusters import train_cli as _cli
from tests.helpers import assert_same_bits, loaded_weights, wait_for_lines

# 256 images, K=3 x batch 8, H=1: 20 rounds of ~0.1 s in 2 epochs; checkpoints at rounds 9, 19.
ARGS = ["--data", "synthetic:256:64", "--model", "small-cnn", "--strategy", "ipm",
        "--replicas", "3", "--batch-size", "8", "--mix-every", "1", "--epochs", "2",
        "--lr", "0.02", "--augment", "cifar", "--seed", "5", "--no-progress"]
ROUNDS = 20
# What a stopped run may print on stderr besides its last line: nothing from the workers.
INFO_PREFIXES = ("output: ", "started local cluster ", "ipm: ", "average: ", "resuming ")


@pytest.fixture(scope="module")
def reference(dask_client) -> dict:
    config = config_from_args(build_parser().parse_args(["train", *ARGS]))
    return train(config, client=dask_client).params


def _quoted_as_printed(line: str, out: Path) -> None:
    """docs/reliability.md quotes the interrupt line: the quote has the printed line's shape."""
    import re
    shape = lambda text: re.sub(r"\d+", "N", re.sub(r"SIG[A-Z]+", "SIG", text))  # noqa: E731
    docs = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    quoted = re.findall(r"`(interrupted after round [^`]*)`", docs)
    assert quoted and all(shape(q) == shape(line.replace(str(out), "OUT")) for q in quoted), \
        (quoted, line)


def _stop_with(sig: int, driver: subprocess.Popen, out: Path, after: int) -> int:
    """Send ``sig`` to the driver's process group once round ``after`` is reported; check the
    exit status, the one line and the checkpoint; return the round it stopped after."""
    wait_for_lines(out / "metrics.jsonl", after + 1, driver, timeout=90.0)
    os.killpg(driver.pid, sig)  # the whole group: driver and worker processes
    _, stderr = driver.communicate(timeout=60)
    assert driver.returncode == 128 + sig, stderr
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert all(x.startswith(INFO_PREFIXES) for x in lines[:-1]), stderr
    last = lines[-1]
    assert last.startswith("interrupted after round ") and last.endswith(
        f"rounds done; {signal.Signals(sig).name}); checkpoint saved; resume: python -m "
        f"pipeline train --resume {out}"), last
    _quoted_as_printed(last, out)
    stopped = int(last.split()[3])
    assert f"round {stopped} ({stopped + 1} of {ROUNDS} rounds done;" in last, last  # one count
    assert after <= stopped < ROUNDS - 1
    assert (out / "checkpoints" / f"round-{stopped:06d}").is_dir()
    assert _rounds(out) == list(range(stopped + 1)) and not (out / "model.npz").exists()
    return stopped


def _rounds(out: Path) -> list[int]:
    return [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def _seconds(out: Path) -> list[float]:
    return [json.loads(x)["seconds"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.cluster
def test_sigint_then_sigterm_mid_run_stop_with_checkpoints_and_resume_to_identical_weights(
        tmp_path, reference):
    out = tmp_path / "run"
    first = _stop_with(signal.SIGINT, _cli(*ARGS, "--workers", "1", "--out", str(out)), out, 3)
    second = _stop_with(signal.SIGTERM, _cli("--resume", str(out), "--workers", "1",
                                             "--no-progress"), out, first + 4)
    resumed = _cli("--resume", str(out), "--workers", "1", "--no-progress")
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    assert f"resuming {out} after round {second}" in stderr
    assert stdout.startswith(f"done: {ROUNDS} rounds")
    assert_same_bits(loaded_weights(out), reference)
    assert _rounds(out) == list(range(ROUNDS))
    seconds = _seconds(out)
    assert seconds == sorted(seconds)  # wall time counts on across both resumes


def test_a_stop_request_in_process_stops_at_a_round_boundary(tmp_path, dask_client, reference):
    """The driver's side alone (no signal): a request during round 5 stops after the rounds in
    flight, checkpoints the last of them, and a resume gives the uninterrupted weights."""
    config = config_from_args(build_parser().parse_args(["train", *ARGS, "--out",
                                                         str(tmp_path)]))
    stop = interrupt.StopRequest()

    def request_at_round_5(line):
        if line["round"] == 5:
            stop.request(signal.SIGTERM)

    with pytest.raises(Interrupted) as err:
        train(config, client=dask_client, on_round=request_at_round_5, stop=stop)
    assert err.value.exit_status == 143
    stopped = int(str(err.value).split()[3])
    assert stopped in (5, 6)  # round 6 may already be in flight when round 5 is reported
    assert (tmp_path / "checkpoints" / f"round-{stopped:06d}").is_dir()
    result = train(config, client=dask_client, resume=True)
    assert_same_bits(result.params, reference)


def test_graceful_stop_sets_the_request_then_forces_on_a_second_signal():
    with interrupt.graceful_stop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested and stop.exit_status == 143
        with pytest.raises(interrupt.ForcedStop) as err:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert err.value.exit_status == 130
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # put back


@pytest.mark.timeout(90)
def test_a_signal_during_set_up_stops_at_once_even_in_a_blocking_wait(tmp_path):
    """A scheduler that accepts the connection and never answers: the set-up waits in its
    connect (60 s). One SIGTERM (as ``timeout`` sends) ends it within seconds, one line, 143."""
    import socket
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshake; nobody ever speaks
    try:
        port = silent.getsockname()[1]
        driver = _cli(*ARGS, "--scheduler", f"tcp://127.0.0.1:{port}", "--connect-timeout", "60",
                      "--out", str(tmp_path / "run"))
        time.sleep(4)  # imports done, waiting in the connect
        assert driver.poll() is None, driver.communicate()
        start = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        _, stderr = driver.communicate(timeout=30)
        assert time.monotonic() - start < 15
    finally:
        silent.close()
    assert driver.returncode == 143, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == ("error: interrupted (SIGTERM) while the run was "
                                               "being set up; no round ran and nothing was written")
    assert not (tmp_path / "run").exists()


# A second Ctrl-C while the driver waits in a gather, as `train` does mid-round: distributed
# leaves the gather's per-key waits (raising its AllExit) unretrieved, and asyncio printed each
# as a traceback when they were collected, after our line.
_ABANDONED_GATHER = """
import os, signal, sys, threading, time
import distributed
from pipeline.core.interrupt import ForcedStop, graceful_stop

def twice():
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGINT)

try:
    with graceful_stop(), distributed.LocalCluster(
            n_workers=1, threads_per_worker=3, processes=False,
            dashboard_address="127.0.0.1:0") as cluster, distributed.Client(cluster) as client:
        futures = [client.submit(time.sleep, 4 + i, pure=False) for i in range(3)]
        threading.Thread(target=twice, daemon=True).start()
        client.gather(futures)
except ForcedStop as exc:
    print("stopped at once", file=sys.stderr)
    sys.exit(exc.exit_status)
"""


@pytest.mark.timeout(120)
def test_a_second_signal_in_a_gather_prints_only_our_line():
    import sys

    from tests.clusters import REPO
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", _ABANDONED_GATHER], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "stopped at once\n", done.stderr


def test_asyncios_line_for_an_abandoned_allexit_is_dropped_and_no_other():
    import logging

    class AllExit(Exception):  # distributed.client.AllExit, by its name and package
        __module__ = "distributed.client"

    interrupt.quiet_abandoned_gathers()
    interrupt.quiet_abandoned_gathers()  # once
    logger = logging.getLogger("asyncio")
    filters = [f for f in logger.filters if isinstance(f, interrupt._AbandonedGathers)]
    assert len(filters) == 1

    def record(exc):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task exception was "
                                 "never retrieved", (), (type(exc), exc, None))
    assert not filters[0].filter(record(AllExit()))
    assert filters[0].filter(record(ValueError("a real one")))
    assert filters[0].filter(logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "x", (),
                                               None))
