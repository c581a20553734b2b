"""Benchmark: ours against a plain PyTorch loop on the same cores, same net, data and recipe.

Two parts, each alternating PyTorch and ours in one run:

- ``step``: one training step (forward, cross-entropy, backward, Adam) at batch 100 on one core,
  for each of ``--models`` (cifar10-2015, resnet20), images/s by this thread's CPU clock (the
  machine is shared; ``cpu_img_s``) and by the wall (``wall_img_s``), best of ``--repeats``
  alternations of five configurations: PyTorch with ``torch.set_num_threads(1)`` in fp32 NCHW
  (``torch_fp32``), fp32 channels-last (``torch_fp32_cl``: model and input in
  ``torch.channels_last``) and bf16 autocast channels-last (``torch_bf16_cl``:
  ``torch.autocast("cpu", dtype=torch.bfloat16)``), against our step with one BLAS thread in fp32
  (``ours_fp32``) and bf16 (``ours_bf16``, ``train.precision``; only on a CPU with bf16
  instructions), as benchmarks/cpu_kernels.py's ``make_trainer`` builds it with our kernels as
  the backend installs them. Ratios by the CPU clock, per net: ``fp32_vs_channels_last`` = ours
  fp32 / PyTorch fp32 channels-last, ``bf16_vs_autocast`` = ours bf16 / PyTorch bf16 autocast
  channels-last (goal for both >= 1), and ``per_core_ratio`` = ours fp32 / PyTorch fp32 NCHW
  (the figure of the earlier runs).
- ``train``: time to 0.50 and 0.55 test accuracy and the final accuracy on real CIFAR-10 images
  (the first ``--train-images`` / ``--test-images``, 10,000 / 2,000, of the archive in
  ../shared/data: 0.55 is reached within the run), 15 epochs of cifar10-2015, Adam 1e-3, batch
  100 per replica, pad-crop-flip, evaluation every epoch: PyTorch in one process in each
  ``--torch`` configuration (default 2 and 1 threads, fp32 NCHW; ``2:cl:bf16``: 2 threads,
  channels-last, bf16 autocast), and ours in each ``--ours`` configuration on its own
  LocalCluster (started before the clock; our clock includes putting the data on the cluster),
  each of our runs right after the 2-thread PyTorch run of its precision. ``time_to_055_ratio``:
  our best fp32 configuration over PyTorch fp32 with 2 threads; ``bf16_time_to_055_ratio``: our
  best bf16 configuration over PyTorch bf16 autocast channels-last with 2 threads (goal <= 1 for
  both; each where a run of its precision ran).

PyTorch runs in its own environment (it is no dependency of ours): ``--torch-python`` or
``$PEER_TORCH_PYTHON`` names a Python with torch and NumPy, for example

    python3.11 -m venv /tmp/peer && /tmp/peer/bin/pip install torch numpy
    PEER_TORCH_PYTHON=/tmp/peer/bin/python flock /work/cpu.lock .venv/bin/python \
        benchmarks/peer.py --part step                                # ~2 min on 2 cores
    flock /work/cpu.lock .venv/bin/python benchmarks/peer.py --part train     # ~20 min on 2 cores
    flock /work/cpu.lock .venv/bin/python benchmarks/peer.py --part train \
        --torch 2:cl:bf16 --ours ipm:2:2x1:bf16                 # the 2-core bf16 goal, ~4 min

``--ours`` takes STRATEGY:K:WORKERSxTHREADS[:PRECISION] items, e.g. ``ipm:2:2x1`` (the default:
K=2 replicas on two one-thread workers, H = ``--mix-every``, fp32), ``single:1:1x2``,
``ipm:2:1x2`` (replicas as the threads of one worker), ``ipm:2:2x1:bf16``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import emit, local_client, real_cifar  # noqa: I001

HERE = Path(__file__).resolve().parent
REAL = "/work/shared/data/cifar10-jpeg-20k/cifar-10-python.tar.gz"
TARGETS = (0.50, 0.55)


def torch_python(a) -> str:
    exe = a.torch_python or os.environ.get("PEER_TORCH_PYTHON")
    if not exe:
        sys.exit("peer.py: no PyTorch environment: pass --torch-python PATH or set "
                 "PEER_TORCH_PYTHON (a Python with torch and numpy installed)")
    probe = subprocess.run([exe, "-c", "import torch, numpy; print(torch.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode:
        sys.exit(f"peer.py: {exe} cannot import torch and numpy: "
                 f"{(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    return exe


def run_torch(exe: str, *args: str) -> dict:
    """One PyTorch process; its progress lines pass through, its last line is the result."""
    proc = subprocess.run([exe, str(HERE / "_peer_torch.py"), *args], stdout=subprocess.PIPE,
                          text=True, check=True)
    lines = proc.stdout.strip().splitlines()
    for line in lines[:-1]:
        print("  " + line, flush=True)
    return json.loads(lines[-1])


# ---- step: images/s on one core ----

# PyTorch's configurations of the step part: name -> _peer_torch.py options.
TORCH_STEPS = {"torch_fp32": (), "torch_fp32_cl": ("--channels-last",),
               "torch_bf16_cl": ("--channels-last", "--precision", "bf16")}
# The ratios of the step part: name -> (ours, PyTorch's configuration), thread CPU clock.
STEP_RATIOS = {"per_core_ratio": ("ours_fp32", "torch_fp32"),
               "fp32_vs_channels_last": ("ours_fp32", "torch_fp32_cl"),
               "bf16_vs_autocast": ("ours_bf16", "torch_bf16_cl")}


def our_step(model: str, batch: int, steps: int, precision: str = "fp32") -> dict:
    from threadpoolctl import threadpool_limits

    from cpu_kernels import make_trainer
    step = make_trainer(model, "ours", batch, precision=precision)
    with threadpool_limits(1):
        step(), step()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            step()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return {"wall_img_s": steps * batch / wall, "cpu_img_s": steps * batch / cpu}


def step_sides(a, exe: str, model: str) -> dict:
    """Each configuration's best images/s by each clock over ``a.repeats`` alternations of
    PyTorch's three and our two (our bf16 only where the CPU has bf16 instructions)."""
    from pipeline.core.precision import bf16_support, cpu_flags
    ours = ("fp32",) if bf16_support(cpu_flags()) else ("fp32", "bf16")
    runs = {}
    for _ in range(a.repeats):
        for name, options in TORCH_STEPS.items():
            runs.setdefault(name, []).append(run_torch(
                exe, "step", "--model", model, "--steps", str(a.steps),
                "--batch-size", str(a.batch_size), *options))
        for precision in ours:
            runs.setdefault(f"ours_{precision}", []).append(
                our_step(model, a.batch_size, a.steps, precision))
    return {side: {clock: max(r[clock] for r in rs) for clock in ("cpu_img_s", "wall_img_s")}
            for side, rs in runs.items()}


def step_part(a, exe: str) -> dict:
    from pipeline.backends.chainer.backend import _keep_heap_for_training
    from pipeline.backends.chainer.cpu_kernels import stock
    _keep_heap_for_training()  # as a train- task tunes the heap
    stock.install()  # as the backend does when it builds a replica: our Adam update included
    out = {}
    for model in a.models.split(","):
        best = step_sides(a, exe, model)
        row = {name: (round(best[ours]["cpu_img_s"] / best[theirs]["cpu_img_s"], 3)
                      if ours in best else None) for name, (ours, theirs) in STEP_RATIOS.items()}
        for clock in ("cpu_img_s", "wall_img_s"):  # a dict each: docs/results.md shows the ratios
            row[clock] = {side: round(clocks[clock], 1) for side, clocks in best.items()}
        print(f"step {model} (images/s, thread CPU clock, best of {a.repeats}): "
              + ", ".join(f"{side} {c['cpu_img_s']:.0f}" for side, c in best.items())
              + "; " + ", ".join(f"{name} {row[name]}" for name in STEP_RATIOS), flush=True)
        out[model] = row
    return out


# ---- train: time to an accuracy ----

def load_real(a):
    """The first ``--train-images`` / ``--test-images`` of the archive as uint8 arrays."""
    return real_cifar(a.data, a.train_images, a.test_images)


def first_reach(curve, target):
    return next((t for _, acc, t in curve if acc >= target), None)


def summary(label: str, curve, extra: dict | None = None) -> dict:
    row = {"label": label, "final_acc": curve[-1][1], "seconds": curve[-1][2],
           "s_per_epoch": round(curve[-1][2] / curve[-1][0], 2), **(extra or {})}
    for target in TARGETS:
        reach = first_reach(curve, target)
        row[f"time_to_{int(target * 100):03d}"] = None if reach is None else round(reach, 1)
    print(f"{label:34} " + " ".join(f"{k}={v}" for k, v in row.items() if k != "label"),
          flush=True)
    return row


def ours_item(item: str) -> tuple:
    """``STRATEGY:K:WORKERSxTHREADS[:PRECISION]`` -> (strategy, K, workers, threads, precision).

    >>> ours_item("ipm:2:2x1"), ours_item("single:1:1x2:bf16")
    (('ipm', 2, 2, 1, 'fp32'), ('single', 1, 1, 2, 'bf16'))
    """
    strategy, k, layout, *precision = item.split(":")
    workers, threads = (int(v) for v in layout.split("x"))
    return strategy, int(k), workers, threads, (precision or ["fp32"])[0]


def torch_item(item: str) -> tuple:
    """``THREADS[:LAYOUT[:PRECISION]]`` (LAYOUT nchw or cl, PRECISION fp32 or bf16: autocast)
    -> (threads, channels_last, precision).

    >>> torch_item("2"), torch_item("2:cl:bf16")
    ((2, False, 'fp32'), (2, True, 'bf16'))
    """
    threads, layout, precision = (item.split(":") + ["nchw", "fp32"])[:3]
    if layout not in ("nchw", "cl") or precision not in ("fp32", "bf16"):
        raise SystemExit(f"peer.py: --torch {item}: want THREADS[:nchw|cl[:fp32|bf16]]")
    return int(threads), layout == "cl", precision


def ours_run(item: str, a, arrays) -> dict:
    from pipeline import Config, train
    from pipeline.data.arrays import ArrayData
    from pipeline.data.cifar import CIFAR10_LABEL_NAMES
    strategy, k, workers, threads, precision = ours_item(item)
    cfg = Config().replace(**{
        "model.name": a.model, "train.strategy": strategy, "train.replicas": k,
        "train.optimizer": "adam", "train.lr": a.lr, "train.batch_size": a.batch_size,
        "train.epochs": a.epochs, "augment.policy": "cifar", "seed": a.seed, "progress": False,
        "checkpoint_every": 0, "average.mix_every": a.mix_every, "train.precision": precision})
    data = ArrayData(*arrays, n_classes=10, label_names=tuple(CIFAR10_LABEL_NAMES))
    with local_client(workers, threads) as client:
        start = time.perf_counter()
        out = train(cfg, client=client, data=data, log=lambda m: None)
        total = time.perf_counter() - start
    evals = [h for h in out.history if "test_acc" in h]
    setup = total - out.history[-1]["seconds"]  # data onto the cluster, model, first graph
    curve = [[round(h["epoch_float"], 2), round(h["test_acc"], 4), round(h["seconds"] + setup, 2)]
             for h in evals]
    label = f"ours {strategy} K={k} {workers}x{threads}" + (" bf16" * (precision == "bf16"))
    return summary(label, curve, {"precision": precision, "setup_s": round(setup, 1),
                                  "curve": curve})


def torch_run(item: str, a, exe: str, path: str) -> dict:
    threads, channels_last, precision = torch_item(item)
    r = run_torch(exe, "train", path, "--model", a.model, "--threads", str(threads),
                  "--epochs", str(int(a.epochs)), "--batch-size", str(a.batch_size),
                  "--lr", str(a.lr), "--seed", str(a.seed), "--precision", precision,
                  *(["--channels-last"] if channels_last else []))
    label = (f"PyTorch {r['torch']}, {threads} thread(s)" + ", channels-last" * channels_last
             + ", bf16 autocast" * (precision == "bf16"))
    return summary(label, r["curve"], {"threads": threads, "channels_last": channels_last,
                                       "precision": precision, "curve": r["curve"]})


def best_over(rows: list, ours_precision: str, theirs: dict | None, target: str) -> tuple:
    """(label, ratio): our fastest run of ``ours_precision`` to ``target`` over ``theirs``."""
    reached = [r for r in rows if r["label"].startswith("ours")
               and r["precision"] == ours_precision and r[f"time_to_{target}"] is not None]
    best = min(reached, key=lambda r: r[f"time_to_{target}"]) if reached else None
    if best is None or theirs is None or not theirs[f"time_to_{target}"]:
        return (best["label"] if best else None), None
    return best["label"], round(best[f"time_to_{target}"] / theirs[f"time_to_{target}"], 3)


def train_part(a, exe: str) -> dict:
    import numpy as np

    from augment.ops import CIFAR10_MEAN, CIFAR10_STD
    arrays = load_real(a)
    print(f"data: {len(arrays[0])} train / {len(arrays[2])} test images of {a.data}", flush=True)
    rows, pending = [], list(a.ours)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.npz")
        np.savez(path, x_train=arrays[0], y_train=arrays[1], x_test=arrays[2], y_test=arrays[3],
                 mean=np.asarray(CIFAR10_MEAN), std=np.asarray(CIFAR10_STD))
        for item in a.torch:  # PyTorch and ours alternate: after each 2-thread PyTorch run,
            rows.append(torch_run(item, a, exe, path))  # ours at its precision
            threads, _, precision = torch_item(item)
            mine = [o for o in pending if threads == 2 and ours_item(o)[4] == precision]
            rows += [ours_run(o, a, arrays) for o in mine]
            pending = [o for o in pending if o not in mine]
        rows += [ours_run(o, a, arrays) for o in pending]

    def torch2(channels_last: bool, precision: str):
        return next((r for r in rows if r.get("threads") == 2 and "channels_last" in r
                     and (r["channels_last"], r["precision"]) == (channels_last, precision)),
                    None)
    out = {"runs": rows}
    # ours fp32 over PyTorch fp32 with 2 threads; ours bf16 over PyTorch's bf16 autocast,
    # channels-last, 2 threads: each where a run of that precision ran
    for precision, theirs, prefix in (("fp32", torch2(False, "fp32"), ""),
                                      ("bf16", torch2(True, "bf16"), "bf16_")):
        if any(r["precision"] == precision for r in rows):
            for target in ("050", "055"):
                out[f"best_ours_{prefix}{target}"], out[f"{prefix}time_to_{target}_ratio"] = \
                    best_over(rows, precision, theirs, target)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", default="all", choices=["all", "step", "train"])
    p.add_argument("--torch-python", help="a Python with torch (default: $PEER_TORCH_PYTHON)")
    p.add_argument("--data", default=REAL, help="CIFAR-10 python tarball (real images)")
    p.add_argument("--train-images", type=int, default=10000)
    p.add_argument("--test-images", type=int, default=2000)
    p.add_argument("--model", default="cifar10-2015", help="the net of the train part")
    p.add_argument("--models", default="cifar10-2015,resnet20", help="the nets of the step part")
    p.add_argument("--epochs", type=float, default=15)
    p.add_argument("--batch-size", type=int, default=100, help="per replica")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix-every", default="10", help="ipm's steps per round (H)")
    p.add_argument("--ours", nargs="+", default=["ipm:2:2x1"],
                   help="our configurations: STRATEGY:K:WORKERSxTHREADS[:fp32|bf16]")
    p.add_argument("--torch", nargs="+", default=["2", "1"],
                   help="PyTorch's configurations of the train part: THREADS[:nchw|cl[:fp32|bf16]]"
                        ", e.g. 2:cl:bf16 (channels-last, bf16 autocast, 2 threads)")
    p.add_argument("--steps", type=int, default=5, help="step part: timed steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="step part: alternations, best kept")
    a = p.parse_args(argv)
    exe = torch_python(a)
    figures = {"bench": "peer", "model": a.model, "batch_size": a.batch_size}
    if a.part in ("all", "step"):
        step = step_part(a, exe)
        figures.update({name: {m: row[name] for m, row in step.items()} for name in STEP_RATIOS})
        figures["step"] = step
    if a.part in ("all", "train"):
        if not os.path.exists(a.data):
            sys.exit(f"peer.py: {a.data}: no such file (the train part needs real CIFAR-10)")
        figures.update(train_part(a, exe))
    goals = []
    for name in ("fp32_vs_channels_last", "bf16_vs_autocast"):  # ours against PyTorch's best
        if name in figures:
            goals.append(all(v is not None and v >= 1.0 for v in figures[name].values()))
    for name in ("time_to_055_ratio", "bf16_time_to_055_ratio"):
        if name in figures:
            goals.append(figures[name] is not None and figures[name] <= 1.0)
    figures["goals_met"] = all(goals)
    emit(figures)


if __name__ == "__main__":
    main()
