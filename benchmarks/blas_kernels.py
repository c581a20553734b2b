"""What pinning one OpenBLAS kernel costs: seconds per training step under each kernel.

``--blas-kernel`` (docs/reliability.md) makes every worker of a mixed cluster run one kernel so
the run gives one answer. This times one Adam step (our CPU kernels, one BLAS thread, as a
one-thread worker runs it) of each model under the machine's own kernel and under each named
kernel, in fresh processes (OpenBLAS picks its kernel when it loads), alternating kernels
between repeats so drift hits all of them, and prints each kernel's time over the native one.

    .venv/bin/python benchmarks/blas_kernels.py [--models cifar10-2015 resnet20]
        [--kernels Haswell SkylakeX Sandybridge] [--repeats 3] [--steps 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _common import REPO, emit  # noqa: I001

_CHILD = """
import json, sys
sys.path.insert(0, {bench!r})
import numpy  # noqa: F401 (loads OpenBLAS, which threadpoolctl then reports)
from cpu_kernels import make_trainer, time_steps
from threadpoolctl import threadpool_info, threadpool_limits
threadpool_limits(1)
out = {{"arch": threadpool_info()[0].get("architecture")}}
for model in {models!r}:
    step = make_trainer(model, "ours", {batch})
    step(); step()  # warm-up: allocations, first-call paths
    out[model] = min(time_steps(step, {steps})["wall"] for _ in range(2))
print(json.dumps(out))
"""


def measure(kernel: str | None, a) -> dict:
    """{"arch": what OpenBLAS ran, model: seconds per step} in a fresh process."""
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    if kernel:
        env["OPENBLAS_CORETYPE"] = kernel
    code = _CHILD.format(bench=str(REPO / "benchmarks"), models=a.models, batch=a.batch_size,
                         steps=a.steps)
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(REPO),
                         capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"OPENBLAS_CORETYPE={kernel}: {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["cifar10-2015", "resnet20"])
    p.add_argument("--kernels", nargs="+", default=["Haswell", "SkylakeX", "Sandybridge"])
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    kernels = [None, *a.kernels]
    seconds = {k: {m: [] for m in a.models} for k in kernels}
    arch = {}
    for _ in range(a.repeats):
        for kernel in kernels:
            got = measure(kernel, a)
            arch[kernel] = got["arch"]
            for m in a.models:
                seconds[kernel][m].append(got[m])
    native = arch[None]
    figures = {"native": native}
    for kernel in a.kernels:
        for m in a.models:
            ratio = statistics.median(seconds[kernel][m]) / statistics.median(seconds[None][m])
            figures[f"{kernel}_over_native_{m}"] = round(ratio, 3)
            print(f"{kernel:<11} (runs {arch[kernel]:<11}) {m:<13} "
                  f"{statistics.median(seconds[kernel][m]) * 1e3:7.1f} ms/step, "
                  f"native {native} {statistics.median(seconds[None][m]) * 1e3:7.1f}: "
                  f"{ratio:.3f}x")
    emit(figures)


if __name__ == "__main__":
    main()
