"""Profile: where one training step's time goes on a GPU (Chainer bookkeeping, CuPy launches, kernels).

For each model (cifar10-2015, resnet20), batch (100, 512) and variant (``chainer``: Chainer's
functions and update, i.e. im2col + cuBLAS; ``cudnn``: our cuDNN graphs and the fused update),
the bare step our train- tasks run (normalise uint8 on the device, forward, softmax cross
entropy, backward, Adam update), and per step:

- ``step_ms``: host wall time (the GPU is synchronised only at the end of a run of steps);
- ``kernel_ms``, ``launches``, ``memcpy``: the sum of GPU kernel durations, the number of kernel
  launches and of memcpy/memset calls, from torch.profiler's CUDA activity (CUPTI sees CuPy's
  kernels too); without PyTorch, ``gpu_ms`` (CUDA events around the steps) only;
- ``host_ms``: cProfile's self time per step split by where the code lives: ``chainer``
  (FunctionNode/Variable bookkeeping), ``cupy`` (array creation and kernel launches: CuPy's
  Cython functions show up as C calls), ``cudnn`` (the frontend's execute), ``pipeline`` (our
  code), ``other``; and the 12 largest entries;
- ``float64``: every float64 array seen by a FunctionNode (inputs, output gradients) and among
  the parameters, gradients and optimizer state after a step; must be empty.

A row with ``CUPY_TF32=1`` (CuPy reads it at import, so a child process runs it) is reported for
each variant at batch 512: PyTorch's convolutions use TF32 by default, ours strict FP32.

    python benchmarks/gpu_profile.py                       # on a GPU machine, ~1-2 min on an H100
    python benchmarks/gpu_profile.py --models resnet20 --batches 100 --no-tf32-row
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time

import numpy as np
from _common import emit  # noqa: I001

VARIANTS = {"chainer": {"PIPELINE_GPU_KERNELS": "chainer", "PIPELINE_FUSED_UPDATE": "0"},
            "cudnn": {"PIPELINE_GPU_KERNELS": "cudnn", "PIPELINE_FUSED_UPDATE": "1"}}


def category(filename: str, name: str) -> str:
    """Where a cProfile entry's code lives.

    >>> category("/x/site-packages/chainer/function_node.py", "apply")
    'chainer'
    >>> category("~", "<method 'reduce' of 'cupy._core._kernel.ReductionKernel' objects>")
    'cupy'
    >>> category("/x/pipeline/backends/chainer/gpu_kernels/graphs.py", "execute")
    'pipeline'
    """
    where = filename.replace("\\", "/")
    if "/pipeline/" in where or "/augment/" in where:
        return "pipeline"
    if "/cudnn/" in where or "pygraph" in name:
        return "cudnn"
    if "/chainer/" in where:
        return "chainer"
    if "/cupy" in where or "cupy" in name:
        return "cupy"
    return "other"


def split_profile(stats: pstats.Stats, steps: int, top: int = 12) -> tuple[dict, list]:
    """({category: self ms per step}, [(entry, calls per step, self ms per step)] largest first)."""
    totals: dict = {}
    rows = []
    for (filename, line, name), (_, ncalls, tottime, _, _) in stats.stats.items():
        cat = category(filename, name)
        totals[cat] = totals.get(cat, 0.0) + tottime
        label = f"{cat}:{os.path.basename(filename)}:{line}:{name}"[:110]
        rows.append((label, round(ncalls / steps, 1), round(tottime / steps * 1e3, 4)))
    rows.sort(key=lambda r: -r[2])
    return {k: round(v / steps * 1e3, 3) for k, v in sorted(totals.items())}, rows[:top]


class Float64Watch:
    """A Chainer FunctionHook that records every float64 array a FunctionNode sees."""

    def __init__(self):
        from pipeline.backends.chainer.compat import chainer
        watch = self

        class Hook(chainer.FunctionHook):
            name = "float64-watch"

            def forward_preprocess(self, function, in_data):
                watch._check(function.label, "in", in_data)

            def backward_preprocess(self, function, in_data, out_grad):
                watch._check(function.label, "grad", out_grad)

        self.hook = Hook()
        self.found: list = []

    def _check(self, label, role, arrays):
        for a in arrays:
            if a is not None and getattr(a, "dtype", None) == np.float64:
                self.found.append(f"{label}:{role}:{tuple(a.shape)}")

    def check_link(self, link, optimizer):
        for path, param in link.namedparams():
            for what, a in (("param", param.array), ("grad", param.grad)):
                self._check(path, what, [a])
            rule = param.update_rule
            for slot, a in ((rule.state or {}).items() if rule is not None else ()):
                self._check(path, slot, [a])
        for sub in link.links():  # BatchNorm's running statistics
            for name in sub._persistent:
                a = getattr(sub, name)
                self._check(f"{sub.name}/{name}", "persistent", [a] if hasattr(a, "dtype") else [])


def _setup(model: str, batch: int, seed: int = 0):
    import cupy

    from pipeline.backends.chainer.models import build_model
    from pipeline.backends.chainer.state import make_optimizer, setup_optimizer
    from pipeline.core.rng import rng_for
    from pipeline.data.cifar import synthetic_batch
    images, labels = synthetic_batch(seed, "train", 0, batch * 4)
    link = build_model(model, 10, seed=seed)
    link.to_device("@cupy:0")
    opt = setup_optimizer(make_optimizer("adam", 1e-3), link)
    dev_images = cupy.asarray(images)
    dev_labels = cupy.asarray(labels.astype(np.int32))
    return link, opt, dev_images, dev_labels, rng_for(seed, "dropout", 0, 0)


def make_step(model: str, batch: int, variant: str):
    """A step function (i -> None) of the bare training loop, and the link and optimizer."""
    import augment
    from pipeline.backends.chainer.compat import F, chainer
    from pipeline.backends.chainer.gpu_kernels import fused_update
    link, opt, images, labels, rng = _setup(model, batch)
    kernels = VARIANTS[variant]["PIPELINE_GPU_KERNELS"]

    def step(i):
        lo = (i % 4) * batch
        x = augment.normalize(images[lo:lo + batch])
        t = labels[lo:lo + batch]
        with chainer.using_config("train", True), chainer.using_config("type_check", False), \
                chainer.using_config("gpu_kernels", kernels):
            loss = F.softmax_cross_entropy(link(x, rng=rng), t)
            link.cleargrads()
            loss.backward()
            fused_update.update(opt)

    return step, link, opt


def _torch_activity(step, steps: int):
    """(kernel ms, launches, memcpy/memset calls) per step from torch.profiler, or None."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception:
        return None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    kernel_us, launches, copies = 0.0, 0, 0
    for e in prof.key_averages():  # CUDA activity only: GPU kernels and copies, one key a name
        us = getattr(e, "self_device_time_total", 0.0) or 0.0
        if us <= 0:
            continue
        if "memcpy" in e.key.lower() or "memset" in e.key.lower():
            copies += e.count
        else:
            launches += e.count
            kernel_us += us
    return round(kernel_us / steps / 1e3, 3), round(launches / steps, 1), round(copies / steps, 1)


def profile_config(model: str, batch: int, variant: str, steps: int, warmup: int) -> dict:
    import cupy

    from pipeline.backends.chainer.gpu_kernels import fused_update, graphs
    os.environ.update(VARIANTS[variant])
    step, link, opt = make_step(model, batch, variant)
    sync = cupy.cuda.Device().synchronize
    for i in range(warmup):
        step(i)
    sync()
    start_ev, end_ev = cupy.cuda.Event(), cupy.cuda.Event()
    start = time.perf_counter()
    start_ev.record()
    for i in range(steps):
        step(i)
    end_ev.record()
    end_ev.synchronize()
    wall = (time.perf_counter() - start) / steps
    out = {"step_ms": round(wall * 1e3, 3), "img_s": round(batch / wall, 1),
           "gpu_ms": round(cupy.cuda.get_elapsed_time(start_ev, end_ev) / steps, 3)}
    activity = _torch_activity(step, min(steps, 10))
    if activity is not None:
        out["kernel_ms"], out["launches"], out["memcpy"] = activity
        out["kernel_fraction"] = round(min(1.0, activity[0] / out["step_ms"]), 3)
    prof = cProfile.Profile()
    n_prof = min(steps, 10)
    prof.enable()
    for i in range(n_prof):
        step(i)
    sync()
    prof.disable()
    out["host_ms"], out["top"] = split_profile(pstats.Stats(prof), n_prof)
    watch = Float64Watch()
    with watch.hook:  # a FunctionHook registers for this thread inside the block
        step(0)
    watch.check_link(link, opt)
    out["float64"] = sorted(set(watch.found))
    out["cudnn_graphs"] = dict(graphs.stats)
    out["fused_updates"] = dict(fused_update.stats)
    if variant == "cudnn":
        out["cudnn_unavailable"] = graphs.unavailable_reason()
        out["cudnn_errors"] = dict(list(graphs.errors.items())[:4])
    return out


def _tf32_rows(a) -> dict:
    """The batch-512 rows again in a child process with CUPY_TF32=1."""
    cmd = [sys.executable, __file__, "--models", a.models, "--batches", "512", "--variants",
           a.variants, "--steps", str(a.steps), "--warmup", str(a.warmup), "--no-tf32-row"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.child_timeout,
                              env={**os.environ, "CUPY_TF32": "1"})
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        return {"error": f"CUPY_TF32=1 child ran past {a.child_timeout} s", "output": (out or "")[-800:]}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr or done.stdout)[-800:]}
    return json.loads(lines[-1])["rows"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cifar10-2015,resnet20")
    p.add_argument("--batches", default="100,512")
    p.add_argument("--variants", default="chainer,cudnn", help=f"of {sorted(VARIANTS)}")
    p.add_argument("--steps", type=int, default=30, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-tf32-row", action="store_true", help="skip the CUPY_TF32=1 rows")
    p.add_argument("--child-timeout", type=int, default=240)
    a = p.parse_args(argv)
    from pipeline.backends.chainer import compat
    tf32 = os.environ.get("CUPY_TF32", "0") == "1"
    print(compat.cuda_summary(), f"CUPY_TF32={int(tf32)}", flush=True)
    rows: dict = {}
    for model in a.models.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            for variant in a.variants.split(","):
                key = f"{model}@b{batch}/{variant}" + ("/tf32" if tf32 else "")
                try:
                    rows[key] = profile_config(model, batch, variant, a.steps, a.warmup)
                except Exception as exc:  # one broken row must not hide the others
                    rows[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                r = rows[key]
                print(f"{key:34} step {r.get('step_ms', '-'):>8} ms  kernels "
                      f"{r.get('kernel_ms', '-'):>8} ms  launches {r.get('launches', '-'):>7}  "
                      f"host {r.get('host_ms', r.get('error'))}", flush=True)
                for entry in r.get("top", [])[:6]:
                    print("    ", entry, flush=True)
    result = {"bench": "gpu_profile", "device": compat.cuda_summary(), "tf32": tf32, "rows": rows}
    if not a.no_tf32_row and not tf32:
        result["tf32_rows"] = _tf32_rows(a)
    offenders = {k: r["float64"] for k, r in rows.items() if r.get("float64")}
    result["float64_free"] = not offenders
    if offenders:
        result["float64"] = offenders
        print("float64 arrays in a step:", offenders, flush=True)
    for model in a.models.split(","):
        for batch in a.batches.split(","):
            base, ours = (rows.get(f"{model}@b{batch}/{v}", {}) for v in ("chainer", "cudnn"))
            if "step_ms" in base and "step_ms" in ours:
                result.setdefault("cudnn_speedup", {})[f"{model}@b{batch}"] = round(
                    base["step_ms"] / ours["step_ms"], 3)
    emit(result)
    return 0 if not offenders else 1


if __name__ == "__main__":
    sys.exit(main())
