"""Shared by the training benchmarks: make the repo importable, a LocalCluster, timing helpers."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


@contextlib.contextmanager
def local_client(workers: int, threads: int = 1, resources: dict | None = None,
                 quiet: bool = True):
    """A LocalCluster of worker processes on 127.0.0.1 (no dashboard) and its client; ``quiet``:
    with the housekeeping intervals of the cluster ``train`` starts itself (``embedded.QUIET``),
    else distributed's defaults."""
    import dask
    from distributed import Client, LocalCluster

    from pipeline.cluster.embedded import quiet_config
    with dask.config.set(quiet_config() if quiet else {}):
        cluster = LocalCluster(n_workers=workers, threads_per_worker=threads, processes=True,
                               dashboard_address=None, host="127.0.0.1", resources=resources)
    with cluster, Client(cluster) as client:
        client.wait_for_workers(workers)
        yield client


def same_bits(a: dict, b: dict) -> bool:
    """Whether two states (name -> array) hold the same keys, dtypes, shapes and bytes."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
        for k in a)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def common_arguments(parser, *, epochs: float, batch_size: int, mix_every: str | None = None):
    """The options every training benchmark takes (model, data, epochs, batch, lr, seed, H)."""
    parser.add_argument("--model", default="small-cnn")
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--epochs", type=float, default=epochs)
    parser.add_argument("--batch-size", type=int, default=batch_size, help="per replica")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-kernels", default="ours", choices=["ours", "chainer"],
                        help="convolution/pooling/BatchNorm on CPU: ours or Chainer's functions")
    if mix_every is not None:
        parser.add_argument("--mix-every", default=mix_every, help="steps per round (H)")


def bench_config(a, **fields):
    """A run's Config from the common arguments plus ``fields``; no progress bar, no checkpoints."""
    from pipeline import Config
    base = {"data.source": a.data, "model.name": a.model, "train.batch_size": a.batch_size,
            "train.lr": a.lr, "train.epochs": a.epochs, "seed": a.seed, "progress": False,
            "checkpoint_every": 0, "model.cpu_kernels": a.cpu_kernels}
    if getattr(a, "mix_every", None) is not None:
        base["average.mix_every"] = a.mix_every
    return Config().replace(**{**base, **fields})


def emit(figures: dict) -> None:
    """The last line of every benchmark: one JSON object."""
    print(json.dumps(figures), flush=True)


def real_cifar(path: str, n_train: int, n_test: int | None = None):
    """``(x, y, x_test, y_test)``: the first ``n_train`` training images of a CIFAR-10 python
    tarball (its batches in order) and the first ``n_test`` of its test split (all: None), uint8
    images (N, 3, 32, 32) and their labels."""
    import numpy as np

    from pipeline.data.cifar import LAYOUTS, parse_batch, read_archive
    lay = LAYOUTS["cifar10-python"]
    top, files, _ = read_archive(path, None)
    split = {}
    for name, members in (("train", lay.train), ("test", lay.test)):
        parts = [parse_batch(lay.key, files[f"{top}/{m}"], m) for m in members]
        split[name] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    (x, y), (xt, yt) = split["train"], split["test"]
    return x[:n_train], y[:n_train], xt[:n_test], yt[:n_test]
