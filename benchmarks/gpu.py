"""Benchmark: training images/s on one GPU: PyTorch, bare Chainer on CuPy, our single and our ipm.

For each model (``cifar10-2015``, ``resnet20``) and per-replica batch (100, 512), in one run:

(a) ``torch``   the same architecture in PyTorch, a bare loop (Adam, uint8 batches sent to the
                GPU and normalised there, no per-step sync), PyTorch's defaults incl. cuDNN;
(b) ``chainer`` a bare Chainer-on-CuPy loop over the same model definition we train
                (``pipeline.backends.chainer.models``), same optimizer and data path, once per
                ``--kernels`` entry: ``chainer`` (Chainer's functions: im2col + cuBLAS, and
                Chainer's per-parameter update) and ``cudnn`` (our cuDNN graphs and the fused
                update, ``pipeline.backends.chainer.gpu_kernels``), rows ``chainer`` and
                ``chainer-cudnn``;
(c) ``single``  ``pipeline.train`` with strategy single through the embedded cluster: CPU
                workers augment, one GPU worker trains; steady-state images/s from the rounds'
                wall-clock stamps (the first rounds, with kernel compilation, excluded);
(d) ``ipm``     K = 2 and 4 replicas sharing the one GPU, three ways: one GPU worker running
                the replicas one after another (``serial``), one GPU worker with K threads
                (``threads``), K GPU worker processes on the device (``processes``).

Prints images/s, the ratios (c)/(b), (b)/(a), (d)/(c), mean GPU utilisation over each
measurement (nvidia-smi), and where a step's time goes in (a) and (b): the sum of the GPU kernels'
durations (CUDA activity from torch.profiler, which sees CuPy's kernels too) against the step's
wall time; the rest is the host launching kernels (Python and framework overhead).

The pipeline runs (c), (d) use ``--pipeline-kernels`` (default cudnn) through the
``PIPELINE_GPU_KERNELS``/``PIPELINE_FUSED_UPDATE`` variables their worker processes inherit.
Phases run in order (all bare loops, then all ``single`` runs, then ``ipm``) and each figure is
printed as a ``{"partial": ...}`` JSON line as it lands, so a run cut short keeps what it measured.

    python benchmarks/gpu.py                       # on a GPU machine: ~6 min on an H100
    python benchmarks/gpu.py --models resnet20 --batches 100 --skip-ipm
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import threading
import time

import numpy as np
from _common import emit  # noqa: I001

KERNELS = {"chainer": {"PIPELINE_GPU_KERNELS": "chainer", "PIPELINE_FUSED_UPDATE": "0"},
           "cudnn": {"PIPELINE_GPU_KERNELS": "cudnn", "PIPELINE_FUSED_UPDATE": "1"}}
MEAN = np.array([125.3, 123.0, 113.9], np.float32) / 255  # augment.CIFAR10_MEAN
STD = np.array([63.0, 62.1, 66.7], np.float32) / 255


# ---------------------------------------------------------------------------------------- util
class GpuUtilisation:
    """Mean of nvidia-smi's utilization.gpu sampled every 100 ms while the block runs."""

    def __init__(self):
        self.samples: list[float] = []

    def __enter__(self):
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
             "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):
                self.samples.append(float(line.split(",")[0]))

    def __exit__(self, *exc):
        self._proc.terminate()
        self._proc.wait()
        self._reader.join(timeout=2)

    @property
    def mean(self) -> float | None:
        tail = self.samples[2:] or self.samples  # the first samples predate the work
        return round(float(np.mean(tail)), 1) if tail else None


def _data(batch: int, steps: int):
    from pipeline.data.cifar import synthetic_batch
    n = min(batch * steps, 20480)
    images, labels = synthetic_batch(0, "train", 0, n)
    return images, labels.astype(np.int64), n


def _kernel_seconds(step, steps: int):
    """(sum of GPU kernel durations, the 5 longest kernels) over ``steps`` calls of ``step``.

    torch.profiler's CUDA activity (CUPTI) records every kernel on the device, CuPy's too.
    """
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception:
        return None, []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    kernels = [(e.key, getattr(e, "self_device_time_total", 0.0)) for e in prof.key_averages()]
    total_us = sum(us for _, us in kernels)
    top = [(name[:60], round(us / steps / 1e3, 3))
           for name, us in sorted(kernels, key=lambda kv: -kv[1])[:5]]
    return (total_us / 1e6 if total_us else None), top


SECONDS = {"per_loop": 3.0}  # --seconds


def _timed_loop(step, sync, warmup: int, steps: int, batch: int, profile_steps: int = 10,
                seconds: float | None = None):
    """images/s over ``steps`` steps (fewer if that takes longer than ``seconds``)."""
    seconds = SECONDS["per_loop"] if seconds is None else seconds
    for i in range(warmup):
        step(i)
    sync()
    start = time.perf_counter()
    for i in range(5):
        step(i)
    sync()
    steps = int(min(steps, max(20, seconds / ((time.perf_counter() - start) / 5))))
    with GpuUtilisation() as util:
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        sync()
        wall = time.perf_counter() - start
    kernels, top = _kernel_seconds(step, profile_steps)
    per_step = wall / steps
    out = {"img_s": round(batch * steps / wall, 1), "gpu_util": util.mean,
           "step_ms": round(per_step * 1e3, 3)}
    if kernels is not None:
        out["kernel_ms"] = round(kernels / profile_steps * 1e3, 3)
        out["kernel_fraction"] = round(min(1.0, kernels / profile_steps / per_step), 3)
        out["top_kernels_ms"] = top
    return out


# --------------------------------------------------------------------------------- (a) torch
def torch_model(name: str):
    """The PyTorch port of ``name`` (10 classes): the one in _peer_torch.py, which peer.py uses."""
    from _peer_torch import MODELS
    return MODELS[name](10)


def bench_torch(model: str, batch: int, steps: int, warmup: int) -> dict:
    import torch
    torch.backends.cudnn.benchmark = True
    images, labels, n = _data(batch, steps)
    net = torch_model(model).cuda().train()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    mean = torch.tensor(MEAN * 255, device="cuda").view(1, 3, 1, 1)
    inv_std = 1 / torch.tensor(STD * 255, device="cuda").view(1, 3, 1, 1)
    host_x, host_t = torch.from_numpy(images).pin_memory(), torch.from_numpy(labels).pin_memory()

    def step(i):
        lo = (i * batch) % (n - batch + 1)
        x = host_x[lo:lo + batch].cuda(non_blocking=True).float().sub_(mean).mul_(inv_std)
        t = host_t[lo:lo + batch].cuda(non_blocking=True)
        loss = torch.nn.functional.cross_entropy(net(x), t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return _timed_loop(step, torch.cuda.synchronize, warmup, steps, batch)


# ------------------------------------------------------------------------------- (b) chainer
def bench_chainer(model: str, batch: int, steps: int, warmup: int, type_check: bool = False,
                  kernels: str = "chainer") -> dict:
    import cupy

    from pipeline.backends.chainer.gpu_kernels import fused_update
    os.environ.update(KERNELS[kernels])

    import augment
    from pipeline.backends.chainer.compat import F, chainer
    from pipeline.backends.chainer.models import build_model
    from pipeline.core.rng import rng_for
    from pipeline.backends.chainer.state import make_optimizer, setup_optimizer
    images, labels, n = _data(batch, steps)
    labels = labels.astype(np.int32)
    link = build_model(model, 10, seed=0)
    link.to_device("@cupy:0")
    opt = setup_optimizer(make_optimizer("adam", 1e-3), link)
    rng = rng_for(0, "dropout", 0, 0)

    def step(i):
        lo = (i * batch) % (n - batch + 1)
        x = augment.normalize(cupy.asarray(images[lo:lo + batch]))
        t = cupy.asarray(labels[lo:lo + batch])
        with chainer.using_config("train", True), chainer.using_config("type_check", type_check), \
                chainer.using_config("gpu_kernels", KERNELS[kernels]["PIPELINE_GPU_KERNELS"]):
            loss = F.softmax_cross_entropy(link(x, rng=rng), t)
            link.cleargrads()
            loss.backward()
            fused_update.update(opt)  # Chainer's opt.update() unless PIPELINE_FUSED_UPDATE=1

    return _timed_loop(step, cupy.cuda.Device().synchronize, warmup, steps, batch)


# ------------------------------------------------------------------------------ (c), (d) ours
def bench_pipeline(model: str, batch: int, rounds: int, mix_every: int, replicas: int,
                   variant: str, cpu_workers: int, skip_rounds: int = 1,
                   kernels: str = "cudnn") -> dict:
    """Steady-state training images/s of ``pipeline.train`` on the embedded GPU cluster.

    ``rounds`` rounds of ``mix_every`` steps, two rounds an epoch; the first ``skip_rounds``
    (CuPy compiling its kernels, the cluster warming up) are not counted.
    """
    from pipeline import Config, train
    n_train = batch * replicas * mix_every * 2  # two rounds an epoch
    epochs = max(1, rounds // 2)
    cluster = {"serial": {}, "threads": {"cluster.gpu_threads": replicas},
               "processes": {"cluster.gpu_workers_per_device": replicas}}[variant]
    cfg = Config().replace(**{
        "data.source": f"synthetic:{n_train}:200", "model.name": model,
        "train.strategy": "single" if replicas == 1 else "ipm", "train.replicas": replicas,
        "train.batch_size": batch, "train.optimizer": "adam", "train.lr": 1e-3,
        "train.epochs": epochs, "train.device": "gpu", "average.mix_every": str(mix_every),
        "augment.policy": "cifar", "progress": False, "checkpoint_every": 0,
        "cluster.workers": cpu_workers, **cluster})
    os.environ.update(KERNELS[kernels])  # the GPU worker processes inherit it
    with GpuUtilisation() as util:
        result = train(cfg, log=lambda message: None)
    rounds = result.history
    steady = rounds[skip_rounds:]
    seconds = steady[-1]["seconds"] - rounds[skip_rounds - 1]["seconds"]
    images = sum(r["images"] for r in steady)
    return {"img_s": round(images / seconds, 1), "gpu_util": util.mean, "rounds": len(rounds),
            "images": images}


def _partial(key: str, name: str, figure: dict) -> None:
    print(json.dumps({"partial": key, "run": name, **{k: v for k, v in figure.items()
                                                     if k != "top_kernels_ms"}}), flush=True)


def _guarded(fn, *args, **kwargs) -> dict:
    """One measurement; an exception becomes {"error": ...} so the other figures still come."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:400], "img_s": None}


def _ratio(a: dict | None, b: dict | None):
    if not a or not b or not a.get("img_s") or not b.get("img_s"):
        return None
    return round(a["img_s"] / b["img_s"], 3)


def _ratios(row: dict, pipeline_kernels: str) -> dict:
    bare = row.get("chainer-cudnn" if pipeline_kernels == "cudnn" else "chainer")
    r = {"single_over_chainer": _ratio(row.get("single"), bare),
         "chainer_over_torch": _ratio(row.get("chainer"), row.get("torch")),
         "cudnn_over_torch": _ratio(row.get("chainer-cudnn"), row.get("torch")),
         "cudnn_over_chainer": _ratio(row.get("chainer-cudnn"), row.get("chainer")),
         "type_check_off_gain": _ratio(row.get("chainer"), row.get("chainer-typecheck"))}
    for name, fig in row.items():
        if name.startswith("ipm"):  # (d)/(c); ipm's rounds are shorter (H = 10)
            r[f"{name}_over_single"] = _ratio(fig, row.get("single"))
    return {k: v for k, v in r.items() if v is not None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cifar10-2015,resnet20")
    p.add_argument("--batches", default="100,512")
    p.add_argument("--steps", type=int, default=200, help="timed steps of the bare loops")
    p.add_argument("--seconds", type=float, default=3.0, help="at most this long per bare loop")
    p.add_argument("--kernels", default="chainer,cudnn",
                   help="bare Chainer loops to run: chainer (im2col) and/or cudnn (ours)")
    p.add_argument("--pipeline-kernels", default="cudnn", choices=sorted(KERNELS),
                   help="kernels of the pipeline runs (c) and (d)")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--skip-bare", action="store_true", help="no bare loops (torch or Chainer)")
    p.add_argument("--skip-typecheck", action="store_true",
                   help="skip the bare loop with Chainer's type checks on")
    p.add_argument("--skip-single", action="store_true")
    p.add_argument("--single-images", type=int, default=20000,
                   help="images per round of our single (a round is one train- task)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of each pipeline run")
    p.add_argument("--ipm-mix-every", type=int, default=10, help="H of the ipm runs")
    p.add_argument("--cpu-workers", type=int, default=4, help="augmenting CPU workers")
    p.add_argument("--replicas", default="2,4")
    p.add_argument("--variants", default="serial,threads,processes")
    p.add_argument("--ipm-batches", default="100", help="batches at which (d) runs")
    p.add_argument("--skip-ipm", action="store_true")
    a = p.parse_args(argv)
    SECONDS["per_loop"] = a.seconds
    import cupy
    from pipeline.backends.chainer import compat
    from pipeline.backends.chainer.gpu_kernels import graphs
    print(compat.cuda_summary(), flush=True)
    configs = [(m, int(b)) for m in a.models.split(",") for b in a.batches.split(",")]
    figures = {f"{m}@b{b}": {} for m, b in configs}

    def run(key, name, fn, *args, **kwargs):
        figures[key][name] = fig = _guarded(fn, *args, **kwargs)
        _partial(key, name, fig)
        cupy.get_default_memory_pool().free_all_blocks()

    for model, batch in configs if not a.skip_bare else ():  # phase 1: the bare loops
        key = f"{model}@b{batch}"
        if not a.skip_torch:
            run(key, "torch", bench_torch, model, batch, a.steps, 20)
        for kernels in a.kernels.split(","):
            name = "chainer" if kernels == "chainer" else f"chainer-{kernels}"
            run(key, name, bench_chainer, model, batch, a.steps, 20, kernels=kernels)
        if not a.skip_typecheck:
            run(key, "chainer-typecheck", bench_chainer, model, batch, a.steps, 20,
                type_check=True)
    for model, batch in configs if not a.skip_single else ():  # phase 2: single
        run(f"{model}@b{batch}", "single", bench_pipeline, model, batch, a.rounds,
            max(1, a.single_images // batch), 1, "serial", a.cpu_workers,
            kernels=a.pipeline_kernels)
    for model, batch in configs if not a.skip_ipm else ():  # phase 3: ipm sharing the GPU
        if str(batch) not in a.ipm_batches.split(","):
            continue
        for k in (int(r) for r in a.replicas.split(",")):
            for variant in a.variants.split(","):
                run(f"{model}@b{batch}", f"ipm{k}-{variant}", bench_pipeline, model, batch,
                    a.rounds + 2, a.ipm_mix_every, k, variant, a.cpu_workers,
                    kernels=a.pipeline_kernels)
    ratios = {key: _ratios(row, a.pipeline_kernels) for key, row in figures.items()}
    print(f"{'config':22}{'run':22}{'img/s':>10}{'GPU %':>8}{'kernel/step':>13}")
    for key, row in figures.items():
        for name, fig in row.items():
            frac = fig.get("kernel_fraction")
            print(f"{key:22}{name:22}{fig.get('img_s') or 0:10.1f}{fig.get('gpu_util') or 0:8.1f}"
                  f"{'' if frac is None else f'{frac:13.2f}'}")
        print(key, ratios[key], flush=True)
    singles = [r["single_over_chainer"] for r in ratios.values() if "single_over_chainer" in r]
    frontend = "loaded" if graphs.load() is not None else graphs.unavailable_reason()
    emit({"bench": "gpu", "device": compat.cuda_summary(), "cudnn_frontend": frontend,
          "cudnn_graphs": dict(graphs.stats),
          "pipeline_kernels": a.pipeline_kernels, "img_s": figures, "ratios": ratios,
          "min_single_over_chainer": min(singles) if singles else None})


if __name__ == "__main__":
    main()
