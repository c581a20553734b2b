"""Benchmark: ours against a plain PyTorch loop on the same cores, same net, data and recipe.

Two parts, each alternating PyTorch and ours in one run:

- ``step``: one training step (forward, cross-entropy, backward, Adam) at batch 100 on one core,
  images/s by this thread's CPU clock (the machine is shared) and by the wall: PyTorch with
  ``torch.set_num_threads(1)`` against our step with one BLAS thread (benchmarks/cpu_kernels.py's
  step, our kernels as the backend installs them). ``per_core_ratio``: ours / PyTorch (goal >= 1).
- ``train``: time to 0.50 and 0.55 test accuracy and the final accuracy on real CIFAR-10 images
  (the first ``--train-images`` / ``--test-images``, 10,000 / 2,000, of the archive in
  ../shared/data: 0.55 is reached within the run), 15 epochs of cifar10-2015, Adam 1e-3, batch 100 per replica, pad-crop-flip, evaluation every epoch:
  PyTorch in one process with 1 and 2 threads, and ours in each ``--ours`` configuration on its
  own LocalCluster (started before the clock; our clock includes putting the data on the
  cluster). ``time_to_055_ratio``: our best configuration over PyTorch with 2 threads (goal <= 1).

PyTorch runs in its own environment (it is no dependency of ours): ``--torch-python`` or
``$PEER_TORCH_PYTHON`` names a Python with torch and NumPy, for example

    python3.11 -m venv /tmp/peer && /tmp/peer/bin/pip install torch numpy
    PEER_TORCH_PYTHON=/tmp/peer/bin/python .venv/bin/python benchmarks/peer.py --part step
    flock /work/cpu.lock .venv/bin/python benchmarks/peer.py --part train     # ~20 min on 2 cores

``--ours`` takes STRATEGY:K:WORKERSxTHREADS items, e.g. ``ipm:2:2x1`` (the default: K=2
replicas on two one-thread workers, H = ``--mix-every``), ``single:1:1x2``, ``ipm:2:1x2``
(replicas as the threads of one worker).
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

from _common import emit, local_client  # noqa: I001

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

def our_step(model: str, batch: int, steps: int) -> dict:
    from threadpoolctl import threadpool_limits

    from cpu_kernels import make_trainer
    step = make_trainer(model, "ours", batch)
    with threadpool_limits(1):
        step(), step()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            step()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return {"wall_img_s": steps * batch / wall, "cpu_img_s": steps * batch / cpu}


def step_part(a, exe: str) -> dict:
    from pipeline.backends.chainer.backend import _keep_heap_for_training
    from pipeline.backends.chainer.cpu_kernels import stock
    _keep_heap_for_training()  # as a train- task tunes the heap
    stock.install()  # as the backend does when it builds a replica: our Adam update included
    out = {}
    for model in a.models.split(","):
        torch_runs, ours_runs = [], []
        for _ in range(a.repeats):
            torch_runs.append(run_torch(exe, "step", "--model", model, "--steps", str(a.steps),
                                        "--batch-size", str(a.batch_size)))
            ours_runs.append(our_step(model, a.batch_size, a.steps))
        best = {side: {clock: max(r[clock] for r in runs) for clock in ("cpu_img_s", "wall_img_s")}
                for side, runs in (("torch", torch_runs), ("ours", ours_runs))}
        ratio = best["ours"]["cpu_img_s"] / best["torch"]["cpu_img_s"]
        print(f"step {model}: PyTorch {best['torch']['cpu_img_s']:.0f} img/s, ours "
              f"{best['ours']['cpu_img_s']:.0f} img/s (thread CPU clock, best of {a.repeats}): "
              f"{ratio:.3f}", flush=True)
        out[model] = {"torch_cpu_img_s": round(best["torch"]["cpu_img_s"], 1),
                      "ours_cpu_img_s": round(best["ours"]["cpu_img_s"], 1),
                      "torch_wall_img_s": round(best["torch"]["wall_img_s"], 1),
                      "ours_wall_img_s": round(best["ours"]["wall_img_s"], 1),
                      "per_core_ratio": round(ratio, 3)}
    return out


# ---- train: time to an accuracy ----

def load_real(a):
    """The first ``--train-images`` / ``--test-images`` of the archive as uint8 arrays."""
    import numpy as np

    from pipeline.data.cifar import LAYOUTS, parse_batch, read_archive
    lay = LAYOUTS["cifar10-python"]
    top, files, _ = read_archive(a.data, None)
    split = {}
    for name, members in (("train", lay.train), ("test", lay.test)):
        parts = [parse_batch(lay.key, files[f"{top}/{m}"], m) for m in members]
        split[name] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    (x, y), (xt, yt) = split["train"], split["test"]
    return x[:a.train_images], y[:a.train_images], xt[:a.test_images], yt[:a.test_images]


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


def ours_run(item: str, a, arrays) -> dict:
    from pipeline import Config, train
    from pipeline.data.arrays import ArrayData
    from pipeline.data.cifar import CIFAR10_LABEL_NAMES
    strategy, k, layout = item.split(":")
    workers, threads = (int(v) for v in layout.split("x"))
    cfg = Config().replace(**{
        "model.name": a.model, "train.strategy": strategy, "train.replicas": int(k),
        "train.optimizer": "adam", "train.lr": a.lr, "train.batch_size": a.batch_size,
        "train.epochs": a.epochs, "augment.policy": "cifar", "seed": a.seed, "progress": False,
        "checkpoint_every": 0, "average.mix_every": a.mix_every})
    data = ArrayData(*arrays, n_classes=10, label_names=tuple(CIFAR10_LABEL_NAMES))
    with local_client(workers, threads) as client:
        start = time.perf_counter()
        out = train(cfg, client=client, data=data, log=lambda m: None)
        total = time.perf_counter() - start
    evals = [h for h in out.history if "test_acc" in h]
    setup = total - out.history[-1]["seconds"]  # data onto the cluster, model, first graph
    curve = [[round(h["epoch_float"], 2), round(h["test_acc"], 4), round(h["seconds"] + setup, 2)]
             for h in evals]
    return summary(f"ours {strategy} K={k} {workers}x{threads}", curve,
                   {"setup_s": round(setup, 1), "curve": curve})


def train_part(a, exe: str) -> dict:
    import numpy as np

    from augment.ops import CIFAR10_MEAN, CIFAR10_STD
    arrays = load_real(a)
    print(f"data: {len(arrays[0])} train / {len(arrays[2])} test images of {a.data}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.npz")
        np.savez(path, x_train=arrays[0], y_train=arrays[1], x_test=arrays[2], y_test=arrays[3],
                 mean=np.asarray(CIFAR10_MEAN), std=np.asarray(CIFAR10_STD))
        for threads in (2, 1):  # PyTorch and ours alternate
            r = run_torch(exe, "train", path, "--model", a.model, "--threads", str(threads),
                          "--epochs", str(int(a.epochs)), "--batch-size", str(a.batch_size),
                          "--lr", str(a.lr), "--seed", str(a.seed))
            rows.append(summary(f"PyTorch {r['torch']}, {threads} thread(s)", r["curve"],
                                {"threads": threads, "curve": r["curve"]}))
            if threads == 2:
                rows += [ours_run(item, a, arrays) for item in a.ours]
    torch2 = next(r for r in rows if r.get("threads") == 2)
    ours = [r for r in rows if r["label"].startswith("ours")]
    out = {"runs": rows}
    for target in ("050", "055"):  # ours at its best configuration over PyTorch with 2 threads
        reached = [r for r in ours if r[f"time_to_{target}"] is not None]
        best = min(reached, key=lambda r: r[f"time_to_{target}"]) if reached else None
        theirs = torch2[f"time_to_{target}"]
        out[f"best_ours_{target}"] = best["label"] if best else None
        out[f"time_to_{target}_ratio"] = (round(best[f"time_to_{target}"] / theirs, 3)
                                          if best and theirs else None)
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
                   help="our configurations: STRATEGY:K:WORKERSxTHREADS")
    p.add_argument("--steps", type=int, default=5, help="step part: timed steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="step part: alternations, best kept")
    a = p.parse_args(argv)
    exe = torch_python(a)
    figures = {"bench": "peer", "model": a.model, "batch_size": a.batch_size}
    if a.part in ("all", "step"):
        figures["step"] = step_part(a, exe)
        figures["per_core_ratio"] = {m: v["per_core_ratio"] for m, v in figures["step"].items()}
    if a.part in ("all", "train"):
        if not os.path.exists(a.data):
            sys.exit(f"peer.py: {a.data}: no such file (the train part needs real CIFAR-10)")
        figures.update(train_part(a, exe))
    goals = []
    if "per_core_ratio" in figures:
        goals.append(all(v >= 1.0 for v in figures["per_core_ratio"].values()))
    if "time_to_055_ratio" in figures:
        goals.append(figures["time_to_055_ratio"] is not None
                     and figures["time_to_055_ratio"] <= 1.0)
    figures["goals_met"] = all(goals)
    emit(figures)


if __name__ == "__main__":
    main()
