"""Benchmark: our `single` pipeline on a one-worker LocalCluster vs a bare Chainer loop.

Same model, data, batch size, epochs and threads (one). The bare loop is the Chainer + Dask post's
``run_epoch`` (docs/references.md): shuffle, slice batches, normalize, ``optimizer.update``, then
test accuracy once per epoch. Ours is ``pipeline.train`` with strategy ``single`` (rounds of
``--mix-every`` steps, augmentation ``none``, evaluation each epoch) on a client made beforehand, so
the cluster's start is not counted; loading is. Target: ours >= 0.9 of the bare loop's images/s.

    .venv/bin/python benchmarks/overhead.py                 # ~4 min on 2 cores
"""
from __future__ import annotations

import argparse
import time

from _common import bench_config, common_arguments, emit, local_client, timed  # noqa: I001


def bare_loop(model_name: str, source: str, epochs: int, batch: int, lr: float, seed: int,
              kernels: str = "ours"):
    """The single-process loop of the Chainer + Dask post (docs/references.md); returns
    (images/s, test accuracy)."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    import augment
    from pipeline.backends.chainer.compat import F, chainer
    from pipeline.data.datasets import dataset_arrays, load_dataset
    from pipeline.backends.chainer.models import build_model
    x, y, xt, yt = dataset_arrays(load_dataset(source))
    model = build_model(model_name, int(y.max()) + 1, seed=seed)
    optimizer = chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9)
    optimizer.setup(model)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    with threadpool_limits(1), chainer.using_config("cpu_kernels", kernels):
        for _ in range(epochs):
            order = rng.permutation(len(y))
            with chainer.using_config("train", True):
                for lo in range(0, len(y) - batch + 1, batch):
                    idx = order[lo:lo + batch]
                    loss = F.softmax_cross_entropy(model(augment.normalize(x[idx]), rng=rng), y[idx])
                    model.cleargrads()
                    loss.backward()
                    optimizer.update()
            with chainer.using_config("train", False), chainer.no_backprop_mode():
                pred = np.concatenate([model(augment.normalize(xt[i:i + 1000])).array.argmax(1)
                                       for i in range(0, len(yt), 1000)])
    seconds = time.perf_counter() - start
    steps = len(y) // batch
    return steps * batch * epochs / seconds, float((pred == yt).mean())


def ours(client, a):
    from pipeline import train
    cfg = bench_config(a, **{"train.strategy": "single", "train.replicas": 1,
                             "augment.policy": "none"})
    result, seconds = timed(train, cfg, client=client, log=lambda m: None)
    n = result.history[-1]["step"] * a.batch_size
    return n / seconds, result.history[-1]["test_acc"], result.history


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(p, epochs=2, batch_size=32, mix_every="50")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs; best of each kept")
    a = p.parse_args(argv)
    bare_runs, our_runs = [], []
    with local_client(1, 1) as client:
        for _ in range(a.repeats):  # interleaved, best of each: the 2 cores are shared
            bare_runs.append(bare_loop(a.model, a.data, int(a.epochs), a.batch_size, a.lr,
                                       a.seed, a.cpu_kernels))
            our_runs.append(ours(client, a))
    bare_img_s, bare_acc = max(bare_runs)
    ours_img_s, ours_acc, history = max(our_runs, key=lambda r: r[0])
    ratio = ours_img_s / bare_img_s
    print(f"{'':24}{'images/s':>10}{'test acc':>10}")
    print(f"{'bare Chainer loop':24}{bare_img_s:10.0f}{bare_acc:10.3f}")
    print(f"{'pipeline single, 1 worker':24}{ours_img_s:10.0f}{ours_acc:10.3f}")
    print(f"ratio ours/bare = {ratio:.3f} (target >= 0.9); {len(history)} rounds of "
          f"{a.mix_every} steps")
    emit({"bench": "overhead", "ratio": round(ratio, 4), "bare_img_s": round(bare_img_s, 1),
          "ours_img_s": round(ours_img_s, 1), "model": a.model, "epochs": a.epochs,
          "batch_size": a.batch_size, "mix_every": a.mix_every, "cpu_kernels": a.cpu_kernels,
          "target": 0.9})


if __name__ == "__main__":
    main()
