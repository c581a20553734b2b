"""The bf16 benchmarks run end to end without PyTorch or real data: benchmarks/precision_accuracy.py
on a few synthetic images (its last line one JSON object with the gaps), and the item syntax of
benchmarks/peer.py's train part (its PyTorch side needs torch, which is no dependency of ours)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.backends.chainer.cpu_kernels import onednn
from pipeline.core import precision

from .helpers import REPO

BENCHMARKS = REPO / "benchmarks"
HAS_BF16 = onednn.load() is not None and precision.bf16_support(precision.cpu_flags()) is None


def _run(script: str, *args: str) -> list:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()


@pytest.mark.parametrize("runs", [
    ["single:fp32", "ipm:fp32"],
    pytest.param(["single:fp32", "single:bf16"], marks=pytest.mark.skipif(
        not HAS_BF16, reason="bf16 needs oneDNN and a CPU with bf16 instructions")),
])
def test_precision_accuracy_smoke(runs):
    lines = _run("precision_accuracy.py", "--data", "synthetic", "--train-images", "200",
                 "--test-images", "100", "--epochs", "1", "--workers", "1", "--runs", *runs)
    last = json.loads(lines[-1])
    assert last["bench"] == "precision_accuracy"
    assert [json.loads(line)["run"] for line in lines[-1 - len(runs):-1]] == runs
    for run in runs:
        assert 0 <= last[run.replace(":", "_") + "_final"] <= 1
    assert ("bf16_gap_single" in last) == ("single:bf16" in runs)


def test_peer_items_parse():
    """peer.py's doctests (its --ours and --torch items) in a process of their own: importing
    it puts benchmarks/ on the path."""
    proc = subprocess.run([sys.executable, "-m", "doctest", str(BENCHMARKS / "peer.py")],
                          capture_output=True, text=True, timeout=60, cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_cpu_kernels_threads_smoke():
    """benchmarks/cpu_kernels.py --threads: one replica's step on 1 and 2 kernel threads."""
    lines = _run("cpu_kernels.py", "--threads", "1,2", "--models", "small-cnn", "--steps", "1",
                 "--repeats", "1", "--batch-size", "16")
    last = json.loads(lines[-1])
    assert last["bench"] == "cpu_kernels_threads"
    row = last["models"]["small-cnn fp32"]
    assert row["1_threads_img_s"] > 0 and row["2_threads_img_s"] > 0
    assert row["2_threads_over_1"] > 0
