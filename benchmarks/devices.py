"""Benchmark: training images/s of one train- task per model on the CPU and, where CuPy sees a GPU, on it.

Calls ``pipeline.training.tasks.train`` directly (what a train- task runs: uint8 in, normalize on the
device, ``--steps`` optimizer steps, host state out), after one warm-up call per device.
CPU runs use ``--threads`` BLAS threads.

    .venv/bin/python benchmarks/devices.py                      # CPU only here: ~2 min
    python benchmarks/devices.py --models cifar10-2015,resnet20 --batch-size 128   # on a GPU box
"""
from __future__ import annotations

import argparse
import time

from _common import emit  # noqa: I001


def devices():
    found = ["cpu"]
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            found.append("gpu")
    except Exception:
        pass
    return found


def images_per_second(model: str, device: str, batch: int, steps: int) -> float:
    from pipeline.training import tasks
    from pipeline.data.cifar import synthetic_batch
    from pipeline.data.readers import Shard
    images, labels = synthetic_batch(0, "train", 0, batch * steps)
    params = tasks.init_params(model, 10, seed=0)
    spec = tasks.StepSpec(model, 10, "momentum", 0.9, 0.0, (0.01,) * steps, batch, "steps",
                          0, 0, 0, device)
    shard = Shard(images, labels)
    warm = spec._replace(lrs=(0.01,))
    tasks.train(params, None, shard, warm)
    if device != "cpu":
        import cupy
        cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    tasks.train(params, None, shard, spec)  # returns host arrays: the device work is done
    return batch * steps / (time.perf_counter() - start)


def main(argv=None):
    from threadpoolctl import threadpool_limits
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="small-cnn,resnet20,cifar10-2015")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    figures = {}
    print(f"{'model':14}{'device':10}{'images/s':>10}")
    for model in a.models.split(","):
        for device in devices():
            with threadpool_limits(a.threads):
                rate = images_per_second(model, device, a.batch_size, a.steps)
            figures[f"{model}@{device.strip('@')}"] = round(rate, 1)
            print(f"{model:14}{device:10}{rate:10.1f}")
    emit({"bench": "devices", "batch_size": a.batch_size, "threads": a.threads,
          "img_s": figures})


if __name__ == "__main__":
    main()
