"""Benchmark: training images/s on one CPU thread with Chainer's functions, with ours, and the GEMM-only bound.

For each model: batch ``--batch-size`` (100), Adam, one BLAS thread (threadpoolctl), the heap
tuned as in a train- task (``chainer_backend._keep_heap_for_training``). A step is forward, softmax
cross-entropy, backward and ``optimizer.update()``. Chainer's functions (``cpu_kernels
"chainer"``), ours, and ours with oneDNN turned off (every convolution by im2col + BLAS,
``onednn.turned_off``; the same as ours where oneDNN is not installed) run interleaved,
``--repeats`` rounds of ``--steps`` steps each, best round kept. The GEMM-only bound is that of
the im2col path: every matrix product of one of its steps (the convolutions' products as
issued, chunk by chunk, recorded through ``convolution.gemm``; the Linear layers' forward, gx
and gW products) replayed alone on operands of the same shapes and memory orders, in the same
run; oneDNN's convolutions do not issue those products, so ours can pass that bound. Images/s by the wall clock and by this thread's CPU time (the machine is shared).
Ours runs as the backend installs it (``cpu_kernels.stock.install()``: Adam's update by slices);
a third interleaved run, ours with Chainer's own Adam update, gives that update's share.

    .venv/bin/python benchmarks/cpu_kernels.py                  # ~2 min on 2 cores
    .venv/bin/python benchmarks/cpu_kernels.py --profile        # also: where one step's time goes
    .venv/bin/python benchmarks/cpu_kernels.py --precision fp32,bf16 --models cifar10-2015
        # ours in fp32 against ours with bf16 convolutions (train.precision), and the cost of
        # the NumPy fp32 -> bf16 rounding of one batch's activations against oneDNN's reorder
    flock /work/cpu.lock .venv/bin/python benchmarks/cpu_kernels.py --threads 1,2 \
        --precision fp32,bf16 --models cifar10-2015,resnet20
        # one replica's step on 1 and 2 kernel threads (a quiet machine: the wall clock)

Goals (issue 15): ours >= 2.3x Chainer's functions on cifar10-2015, and >= 0.55 of the bound.
"""
from __future__ import annotations

import argparse
import collections
import time

from _common import emit  # noqa: I001

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def make_trainer(name: str, kernels: str, batch: int, seed: int = 0, precision: str = "fp32"):
    """A zero-argument step function: one Adam step of ``name`` on a fixed seeded batch
    (``precision``: the convolutions' inputs, as ``train.precision``)."""
    import numpy as np

    import augment
    from pipeline.data.cifar import synthetic_batch
    from pipeline.backends.chainer.compat import F, chainer
    from pipeline.backends.chainer.models import build_model
    model = build_model(name, 10, seed=seed)
    optimizer = chainer.optimizers.Adam(alpha=1e-3)
    optimizer.setup(model)
    images, labels = synthetic_batch(seed, "train", 0, batch)
    x, t = augment.normalize(images), labels.astype(np.int32)
    rng = np.random.default_rng(seed)

    def step():
        with chainer.using_config("train", True), chainer.using_config("cpu_kernels", kernels), \
                chainer.using_config("cpu_precision", precision):
            loss = F.softmax_cross_entropy(model(x, rng=rng), t)
            model.cleargrads()
            loss.backward()
            optimizer.update()
    step.model, step.optimizer, step.kernels = model, optimizer, kernels
    return step


def time_steps(step, steps: int) -> dict:
    """Seconds per step of ``steps`` consecutive steps, by each clock."""
    start = {k: c() for k, c in CLOCKS.items()}
    for _ in range(steps):
        step()
    return {k: (c() - start[k]) / steps for k, c in CLOCKS.items()}


# ---- the GEMM-only bound -------------------------------------------------------------------

def _layout(a) -> str:
    return "F" if (a.ndim == 2 and not a.flags.c_contiguous and a.flags.f_contiguous) else "C"


def record_products(step) -> list:
    """Run one step of ``step`` (our kernels) and list its matrix products.

    Each product is ``(tag, (a shape, a order), (b shape, b order))``, the tag naming the
    outermost Chainer function and pass it ran in (as the profile does).
    """
    from pipeline.backends.chainer.compat import chainer
    from pipeline.backends.chainer.cpu_kernels import convolution
    products, where = [], []
    gemm = convolution.gemm

    def recording(a, b, out=None):
        products.append((where[0], (a.shape, _layout(a)), (b.shape, _layout(b))))
        return gemm(a, b, out)

    class Tagger(chainer.FunctionHook):
        name = "GemmTagger"

        def forward_preprocess(self, function, in_data):
            where.append(f"{function.label} fwd")
            if function.label == "LinearFunction" and len(where) == 1:
                x, w = in_data[0], in_data[1]
                (bsz, n_in), n_out = x.reshape(len(x), -1).shape, w.shape[0]
                fwd, bwd = "LinearFunction fwd", "LinearFunction bwd"
                products.append((fwd, ((bsz, n_in), "C"), ((n_in, n_out), "F")))  # y = x W^T
                products.append((bwd, ((bsz, n_out), "C"), ((n_out, n_in), "C")))  # gx = gy W
                products.append((bwd, ((n_out, bsz), "F"), ((bsz, n_in), "C")))  # gW = gy^T x

        def backward_preprocess(self, function, in_data, out_grad):
            where.append(f"{function.label} bwd")

        def forward_postprocess(self, function, in_data):
            where.pop()

        def backward_postprocess(self, function, in_data, out_grad):
            where.pop()

    convolution.gemm = recording
    try:
        with Tagger():
            step()
    finally:
        convolution.gemm = gemm
    return products


def replay(products, np, rng) -> callable:
    """A function running exactly these products on preallocated operands (one per shape).

    Called with a dict, it also adds each tag's thread CPU seconds to it.
    """
    def operand(shape, order):
        if (shape, order) not in cache:
            cache[(shape, order)] = (rng.standard_normal(shape, dtype=np.float32) if order == "C"
                                     else rng.standard_normal(shape[::-1], dtype=np.float32).T)
        return cache[(shape, order)]
    cache, calls = {}, []
    for tag, (sa, la), (sb, lb) in products:
        a, b = operand(sa, la), operand(sb, lb)
        out = cache.setdefault(("out", sa[0], sb[1]), np.empty((sa[0], sb[1]), np.float32))
        calls.append((tag, a, b, out))

    def run(seconds: dict | None = None):
        for tag, a, b, out in calls:
            if seconds is None:
                np.matmul(a, b, out=out)
            else:
                start = time.thread_time()
                np.matmul(a, b, out=out)
                seconds[tag] = seconds.get(tag, 0.0) + time.thread_time() - start
    return run


# ---- where the time goes -------------------------------------------------------------------

def profile_step(step, repeats: int = 3) -> dict:
    """Thread CPU seconds per step by Chainer function (forward and backward), optimizer, rest."""
    from pipeline.backends.chainer.compat import chainer

    class Timer(chainer.FunctionHook):
        """Outermost calls only: a backward that runs gradient FunctionNodes counts them in."""
        name = "ThreadTimer"

        def __init__(self):
            self.seconds = collections.defaultdict(float)
            self._start = []

        def _pre(self, *_):
            self._start.append(time.thread_time())

        def _post(self, function, kind):
            start = self._start.pop()
            if not self._start:
                self.seconds[f"{function.label} {kind}"] += time.thread_time() - start

        forward_preprocess = backward_preprocess = _pre

        def forward_postprocess(self, function, in_data):
            self._post(function, "fwd")

        def backward_postprocess(self, function, in_data, out_grad):
            self._post(function, "bwd")

    timer, total, update = Timer(), 0.0, 0.0
    opt_update = step.optimizer.update

    def timed_update(*args, **kwargs):
        nonlocal update
        start = time.thread_time()
        opt_update(*args, **kwargs)
        update += time.thread_time() - start
    step.optimizer.update = timed_update
    try:
        with timer:
            for _ in range(repeats):
                start = time.thread_time()
                step()
                total += time.thread_time() - start
    finally:
        del step.optimizer.update
    rows = {k: v / repeats for k, v in timer.seconds.items()}
    rows["optimizer update (Adam)"] = update / repeats
    rows["rest (graph, Python)"] = total / repeats - sum(rows.values())
    rows["total"] = total / repeats
    return rows


def print_profile(name: str, profiles: dict) -> None:
    keys = sorted(set().union(*profiles.values()) - {"total"},
                  key=lambda k: -max(p.get(k, 0) for p in profiles.values()))
    print(f"\n{name}: thread CPU ms per step")
    print(f"{'':42}" + "".join(f"{kind:>11}" for kind in profiles))
    for key in keys + ["total"]:
        print(f"{key:42}" + "".join(f"{p.get(key, 0) * 1e3:11.1f}" for p in profiles.values()))


def with_chainers_adam(step):
    """``step`` with Chainer's own Adam update instead of ours by slices (``cpu_kernels.optimizers``)."""
    from pipeline.backends.chainer.cpu_kernels import optimizers

    def run():
        optimizers.uninstall()
        try:
            step()
        finally:
            optimizers.install()
    return run


def without_onednn(step):
    """``step`` with every convolution by im2col + BLAS (``cpu_kernels.onednn.turned_off``)."""
    from pipeline.backends.chainer.cpu_kernels import onednn

    def run():
        with onednn.turned_off():
            step()
    run.model, run.optimizer, run.kernels = step.model, step.optimizer, step.kernels
    return run


def bench_model(name: str, a, np) -> dict:
    chainer_step = make_trainer(name, "chainer", a.batch_size)
    ours_step = make_trainer(name, "ours", a.batch_size)
    ours_adam_step = with_chainers_adam(make_trainer(name, "ours", a.batch_size))
    im2col_step = without_onednn(make_trainer(name, "ours", a.batch_size))
    for step in (chainer_step, ours_step, ours_adam_step, im2col_step):
        step()  # warm-up: lazy allocations, heap growth
    bound = replay(record_products(im2col_step), np, np.random.default_rng(0))
    bound()
    best = collections.defaultdict(lambda: dict.fromkeys(CLOCKS, float("inf")))
    for _ in range(a.repeats):  # interleaved, best of each: the 2 cores are shared
        for label, fn, steps in (("chainer", chainer_step, a.steps), ("ours", ours_step, a.steps),
                                 ("ours_chainer_adam", ours_adam_step, a.steps),
                                 ("ours_im2col", im2col_step, a.steps),
                                 ("gemm", bound, a.steps)):
            for clock, seconds in time_steps(fn, steps).items():
                best[label][clock] = min(best[label][clock], seconds)
    rates = {label: {c: a.batch_size / s for c, s in by_clock.items()}
             for label, by_clock in best.items()}
    if a.profile:
        gemm_seconds = {}
        for _ in range(3):
            bound(gemm_seconds)
        gemm_seconds = {k: v / 3 for k, v in gemm_seconds.items()}
        gemm_seconds["total"] = sum(gemm_seconds.values())
        print_profile(name, {"chainer": profile_step(chainer_step),
                             "ours": profile_step(ours_step),
                             "im2col": profile_step(im2col_step), "im2col GEMM": gemm_seconds})
    return rates


def bench_precisions(name: str, a, precisions: list) -> dict:
    """Images/s of ours at each precision, interleaved, best round of each kept."""
    steps = {p: make_trainer(name, "ours", a.batch_size, precision=p) for p in precisions}
    for step in steps.values():
        step()
    best = collections.defaultdict(lambda: dict.fromkeys(CLOCKS, float("inf")))
    for _ in range(a.repeats):
        for p, step in steps.items():
            for clock, seconds in time_steps(step, a.steps).items():
                best[p][clock] = min(best[p][clock], seconds)
    return {p: {c: a.batch_size / s for c, s in by_clock.items()} for p, by_clock in best.items()}


def main_threads(a) -> None:
    """Ours on 1..n kernel threads (``cpu_kernel_threads``, one BLAS thread: what a train- task
    given n threads runs), each precision, interleaved; best round by the wall clock (the CPU
    clock counts one thread only). Prints each count's speed over one thread's."""
    from pipeline.backends.chainer.compat import chainer
    counts = [int(t) for t in a.threads.split(",")]
    out = {}
    for name in a.models.split(","):
        for p in a.precision.split(","):
            step = make_trainer(name, "ours", a.batch_size, precision=p)
            best = dict.fromkeys(counts, float("inf"))
            for _ in range(a.repeats):
                for n in counts:
                    with chainer.using_config("cpu_kernel_threads", n):
                        step()  # the pool's threads started, the plans of this count built
                        best[n] = min(best[n], time_steps(step, a.steps)["wall"])
            row = {f"{n}_threads_img_s": round(a.batch_size / best[n], 1) for n in counts}
            row.update({f"{n}_threads_over_1": round(best[counts[0]] / best[n], 3)
                        for n in counts[1:]})
            out[f"{name} {p}"] = row
            print(name, p, row)
    emit({"bench": "cpu_kernels_threads", "batch_size": a.batch_size, "optimizer": "adam",
          "clock": "wall", "steps": a.steps, "repeats": a.repeats, "models": out})


def rounding_seconds(np, shape=(100, 32, 32, 32), repeats: int = 20) -> dict:
    """Seconds to round one float32 NHWC activation of ``shape`` to bf16: our NumPy helper
    (``cpu_kernels.bf16.to_bf16``) and oneDNN's reorder (one primitive, one thread), best of
    ``repeats``; the two give the same bits."""
    from pipeline.backends.chainer.cpu_kernels import bf16, dnnl
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    lib = dnnl.load()
    out = np.empty(shape, np.uint16)
    plan = dnnl.Plan.__new__(dnnl.Plan)  # its helpers for memory descriptors and objects
    plan.lib, plan._owned = lib, []
    nchw = (shape[0], shape[3], shape[1], shape[2])
    src, dst = plan._md(nchw, dnnl.TAG_ACDB, dnnl.F32), plan._md(nchw, dnnl.TAG_ACDB, dnnl.BF16)
    pd = plan._pd(lambda ref, engine, *args: lib.dnnl_reorder_primitive_desc_create(
        ref, src, engine, dst, engine, None))
    prim = plan._create(pd)
    args = (dnnl._Arg * 2)(dnnl._Arg(dnnl.ARG_SRC, plan._memory(src, x.ctypes.data)),
                           dnnl._Arg(dnnl.ARG_DST, plan._memory(dst, out.ctypes.data)))
    stream = dnnl.thread_state()["stream"]

    def reorder():
        lib.dnnl_primitive_execute(prim, stream, 2, args)
        lib.dnnl_stream_wait(stream)
    times = {}
    for label, fn in (("numpy", lambda: bf16.to_bf16(x)), ("onednn_reorder", reorder)):
        fn()
        times[label] = min(_seconds(fn) for _ in range(repeats))
    reorder()
    times["same_bits"] = bool(np.array_equal(out, bf16.to_bf16(x)))
    return times


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main_precision(a, np) -> None:
    from pipeline.backends.chainer.cpu_kernels import onednn
    from pipeline.core import precision
    precisions = a.precision.split(",")
    figures = {name: bench_precisions(name, a, precisions) for name in a.models.split(",")}
    out = {}
    for name, r in figures.items():
        out[name] = {f"{p}_img_s": round(r[p][a.clock], 1) for p in precisions}
        if {"fp32", "bf16"} <= set(precisions):
            out[name]["bf16_over_fp32"] = round(r["bf16"][a.clock] / r["fp32"][a.clock], 3)
        print(name, out[name])
    rounding = rounding_seconds(np)
    print("fp32 -> bf16 of a (100, 32, 32, 32) activation:", rounding)
    flags = precision.cpu_flags()
    emit({"bench": "cpu_kernels_precision", "batch_size": a.batch_size, "threads": 1,
          "optimizer": "adam", "onednn": onednn.version() or "off", "clock": a.clock,
          "steps": a.steps, "repeats": a.repeats, "models": out,
          "bf16_flags": sorted(f for f in flags if "bf16" in f),
          "rounding_ms": {k: (round(v * 1e3, 3) if isinstance(v, float) else v)
                          for k, v in rounding.items()}})


def main(argv=None):
    import numpy as np
    from threadpoolctl import threadpool_limits

    from pipeline.backends.chainer.backend import _keep_heap_for_training
    from pipeline.backends.chainer.cpu_kernels import stock
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cifar10-2015,resnet20,small-cnn")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--steps", type=int, default=3, help="steps per timed round")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; best kept")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="which clock the headline ratios use (both are printed)")
    p.add_argument("--profile", action="store_true", help="print a per-function breakdown")
    p.add_argument("--threads", help="a list such as 1,2: ours on each count of kernel threads "
                                      "(--precision's list), interleaved, by the wall clock")
    p.add_argument("--precision", default="fp32",
                   help="fp32: ours against Chainer's functions and the bound; a list such as "
                        "fp32,bf16: ours at each precision (train.precision) only")
    a = p.parse_args(argv)
    _keep_heap_for_training()
    stock.install()  # as the backend does when it builds a replica: our Adam update included
    if a.threads:
        with threadpool_limits(1):
            return main_threads(a)
    if a.precision != "fp32":
        with threadpool_limits(1):
            return main_precision(a, np)
    figures = {}
    with threadpool_limits(1):
        for name in a.models.split(","):
            figures[name] = bench_model(name, a, np)
    from pipeline.backends.chainer.cpu_kernels import onednn
    print(f"\noneDNN: {onednn.version() or onednn.unavailable_reason()}")
    print(f"{'model':14}{'clock':7}{'chainer':>10}{'ours':>10}{'im2col':>10}{'gemm-only':>11}"
          f"{'speedup':>9}{'of bound':>10}{'onednn':>8}   (images/s)")
    out = {}
    for name, r in figures.items():
        for clock in sorted(CLOCKS, key=lambda c: c != a.clock):
            speedup = r["ours"][clock] / r["chainer"][clock]
            fraction = r["ours"][clock] / r["gemm"][clock]
            print(f"{name:14}{clock:7}{r['chainer'][clock]:10.1f}{r['ours'][clock]:10.1f}"
                  f"{r['ours_im2col'][clock]:10.1f}{r['gemm'][clock]:11.1f}{speedup:9.2f}"
                  f"{fraction:10.3f}{r['ours'][clock] / r['ours_im2col'][clock]:8.2f}")
        c = a.clock
        out[name] = {"chainer_img_s": round(r["chainer"][c], 1), "ours_img_s": round(r["ours"][c], 1),
                     "gemm_bound_img_s": round(r["gemm"][c], 1),
                     "speedup_vs_chainer": round(r["ours"][c] / r["chainer"][c], 3),
                     "fraction_of_gemm_bound": round(r["ours"][c] / r["gemm"][c], 3),
                     "ours_with_chainers_adam_img_s": round(r["ours_chainer_adam"][c], 1),
                     "ours_im2col_img_s": round(r["ours_im2col"][c], 1),
                     "onednn_over_im2col": round(r["ours"][c] / r["ours_im2col"][c], 3),
                     "cpu_clock": {k: round(r[k]["cpu"], 1) for k in
                                   ("chainer", "ours", "ours_chainer_adam", "ours_im2col", "gemm")}}
    goal = out.get("cifar10-2015")
    print("goals (cifar10-2015): speedup >= 2.3, fraction of the GEMM-only bound >= 0.55")
    emit({"bench": "cpu_kernels", "batch_size": a.batch_size, "threads": 1, "optimizer": "adam",
          "onednn": onednn.version() or f"off: {onednn.unavailable_reason()}",
          "clock": a.clock, "steps": a.steps, "repeats": a.repeats, "models": out,
          "goals_met": None if goal is None else bool(goal["speedup_vs_chainer"] >= 2.3
                                                       and goal["fraction_of_gemm_bound"] >= 0.55)})


if __name__ == "__main__":
    main()
