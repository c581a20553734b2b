"""What the safe readers cost: a CIFAR batch through plain ``pickle.loads`` (which would run any
code a file carries) against ``cifar.parse_batch`` (restricted unpickler, opcode pass, arrays built
from checked state), and a ``model.npz`` through ``np.load(allow_pickle=True)`` (what Chainer's
``load_npz`` does) against ``pipeline.core.npz.read``.

    python benchmarks/safe_reads.py [--images 10000] [--repeats 7]

Best of ``--repeats``; last line one JSON object with the times and the ratios.
"""
from __future__ import annotations

import argparse
import io
import pickle
import time

from _common import emit


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    import numpy as np

    from pipeline.data import cifar
    from pipeline.data.cifar.write import _py10_batch
    from pipeline.core import npz
    from pipeline.training import tasks
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000, help="images in the batch")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", default="cifar10-2015")
    a = parser.parse_args()

    images, labels = cifar.synthetic_batch(0, "train", 0, a.images)
    raw = cifar.py2_dumps(_py10_batch("training batch 1 of 5", images, labels,
                                      cifar.CIFAR10_LABEL_NAMES, 0))
    plain = best(lambda: pickle.loads(raw, encoding="bytes"), a.repeats)
    safe = best(lambda: cifar.parse_batch("cifar10-python", raw, "bench"), a.repeats)

    params = tasks.init_params(a.model, 10, 0)
    weights = npz.to_bytes(params, compress=True)
    specs = npz.specs_of(params)

    def numpy_load():
        with np.load(io.BytesIO(weights), allow_pickle=True) as f:
            return {k: f[k] for k in f.files}
    np_time = best(numpy_load, a.repeats)
    ours = best(lambda: npz.read_bytes(weights, "bench", specs), a.repeats)

    print(f"CIFAR batch of {a.images} images ({len(raw) / 1e6:.1f} MB): pickle.loads "
          f"{plain * 1e3:.1f} ms, parse_batch {safe * 1e3:.1f} ms")
    print(f"{a.model} weights ({len(weights) / 1e6:.1f} MB deflated): np.load "
          f"{np_time * 1e3:.1f} ms, npz.read {ours * 1e3:.1f} ms")
    emit({"batch_images": a.images, "pickle_loads_s": round(plain, 4),
          "parse_batch_s": round(safe, 4), "parse_over_pickle": round(safe / plain, 2),
          "model": a.model, "np_load_s": round(np_time, 4), "npz_read_s": round(ours, 4),
          "npz_over_np_load": round(ours / np_time, 2)})


if __name__ == "__main__":
    main()
