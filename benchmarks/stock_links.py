"""Benchmark: a VGG-style net of Chainer's stock links against the same net of our wrappers, one CPU thread.

The net (conv3x3-BN-ReLU twice, 2x2 max-pool, at 32-64-128 channels; fc 256, dropout 0.5,
fc 10; 0.81 M parameters) is written twice: with ``L.Convolution2D``, ``L.BatchNormalization``
and ``F.max_pooling_2d`` only (what a user brings; ``cpu_kernels.stock`` dispatches them to our
kernels), and with our wrappers (``cpu_kernels.Convolution2D``, ``.BatchNormalization``,
``.max_pooling_2d``). ``L.Linear`` and ``F.dropout`` are Chainer's in both. Same initial weights,
same batch. A step is forward, softmax cross-entropy, backward, ``Adam.update()``; batch
``--batch-size`` (100), one BLAS thread, the heap tuned as in a train- task. The stock net
(ours dispatched), the wrapper net and the stock net on Chainer's functions
(``cpu_kernels "chainer"``: what the stock net ran before dispatching) run interleaved,
``--repeats`` rounds of ``--steps`` steps, best round kept; ratio = stock / wrappers images/s.

    .venv/bin/python benchmarks/stock_links.py          # ~1 min on 2 cores

Goal (issue 23): the stock net >= 0.9 of the wrapper net's images/s.
"""
from __future__ import annotations

import argparse
import collections
import time

from _common import emit  # noqa: I001

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
WIDTHS = (32, 64, 128)  # channels of the three conv pairs; each pair ends in a 2x2 max-pool


def make_vgg(kind: str):
    """The VGG-style Chain: ``kind`` "stock" (Chainer's links and F.*) or "ours" (our wrappers)."""
    import numpy as np

    from pipeline.backends.chainer import cpu_kernels as K
    from pipeline.backends.chainer.compat import F, L, chainer
    conv, bn, pool = ((L.Convolution2D, L.BatchNormalization, F.max_pooling_2d) if kind == "stock"
                      else (K.Convolution2D, K.BatchNormalization, K.max_pooling_2d))

    class VGG(chainer.Chain):
        def __init__(self, n_classes: int = 10):
            super().__init__()
            with self.init_scope():
                cin = 3
                for i, cout in enumerate(w for w in WIDTHS for _ in range(2)):
                    setattr(self, f"conv{i}", conv(cin, cout, 3, pad=1, nobias=True))
                    setattr(self, f"bn{i}", bn(cout))
                    cin = cout
                self.fc1 = L.Linear(WIDTHS[-1] * 4 * 4, 256)
                self.fc2 = L.Linear(256, n_classes)

        def forward(self, x):
            h = x
            for i in range(2 * len(WIDTHS)):
                h = F.relu(getattr(self, f"bn{i}")(getattr(self, f"conv{i}")(h)))
                if i % 2:
                    h = pool(h, 2)
            return self.fc2(F.dropout(F.relu(self.fc1(h)), 0.5))

    np.random.seed(0)  # Chainer's default initializers draw from NumPy's global RNG
    return VGG()


def make_trainer(kind: str, kernels: str, batch: int, seed: int = 0):
    """A zero-argument step function: one Adam step of the ``kind`` net on a fixed batch."""
    import numpy as np

    import augment
    from pipeline.backends.chainer.compat import F, chainer
    from pipeline.data.cifar import synthetic_batch
    model = make_vgg(kind)
    optimizer = chainer.optimizers.Adam(alpha=1e-3)
    optimizer.setup(model)
    images, labels = synthetic_batch(seed, "train", 0, batch)
    x, t = augment.normalize(images), labels.astype(np.int32)

    def step():
        with chainer.using_config("train", True), chainer.using_config("cpu_kernels", kernels):
            loss = F.softmax_cross_entropy(model(x), t)
            model.cleargrads()
            loss.backward()
            optimizer.update()
        return loss
    step.model = model
    return step


def our_nodes(step) -> int:
    """FunctionNodes of our kernels in one step's graph."""
    seen, todo, n = set(), [step().creator_node], 0
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        n += type(node).__module__.endswith("cpu_kernels.functions")
        todo.extend(v.creator_node for v in node.inputs)
    return n


def time_steps(step, steps: int) -> dict:
    start = {k: c() for k, c in CLOCKS.items()}
    for _ in range(steps):
        step()
    return {k: (c() - start[k]) / steps for k, c in CLOCKS.items()}


def main(argv=None):
    import os

    from threadpoolctl import threadpool_limits

    from pipeline.backends.chainer.backend import _keep_heap_for_training
    from pipeline.backends.chainer.cpu_kernels import stock
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--steps", type=int, default=2, help="steps per timed round")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; best kept")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    a = p.parse_args(argv)
    _keep_heap_for_training()
    stock.install()  # what the backend does when it builds a replica
    runs = {"stock": make_trainer("stock", "ours", a.batch_size),
            "wrappers": make_trainer("ours", "ours", a.batch_size),
            "stock_chainer": make_trainer("stock", "chainer", a.batch_size)}
    params = int(sum(q.size for q in runs["stock"].model.params()))
    best = collections.defaultdict(lambda: dict.fromkeys(CLOCKS, float("inf")))
    with threadpool_limits(1):
        nodes = {label: our_nodes(step) for label, step in runs.items()}  # also the warm-up
        for _ in range(a.repeats):  # interleaved, best of each: the 2 cores are shared
            for label, step in runs.items():
                for clock, seconds in time_steps(step, a.steps).items():
                    best[label][clock] = min(best[label][clock], seconds)
    rates = {label: {c: a.batch_size / s for c, s in by.items()} for label, by in best.items()}
    print(f"{'net':15}" + "".join(f"{c + ' img/s':>13}" for c in CLOCKS) + f"{'our nodes':>11}")
    for label, r in rates.items():
        print(f"{label:15}" + "".join(f"{r[c]:13.1f}" for c in CLOCKS) + f"{nodes[label]:11d}")
    ratio = rates["stock"][a.clock] / rates["wrappers"][a.clock]
    print(f"stock / wrappers: {ratio:.3f} (goal >= 0.9); load average {os.getloadavg()[0]:.2f}")
    emit({"bench": "stock_links", "net": "vgg-" + "-".join(map(str, WIDTHS)), "params": params,
          "batch_size": a.batch_size, "threads": 1, "optimizer": "adam", "clock": a.clock,
          "steps": a.steps, "repeats": a.repeats,
          "img_s": {label: round(r[a.clock], 1) for label, r in rates.items()},
          "cpu_clock_img_s": {label: round(r["cpu"], 1) for label, r in rates.items()},
          "our_function_nodes": nodes, "ratio": round(ratio, 3),
          "ratio_cpu_clock": round(rates["stock"]["cpu"] / rates["wrappers"]["cpu"], 3),
          "load_average_1min": round(os.getloadavg()[0], 2), "target": 0.9,
          "goal_met": bool(ratio >= 0.9)})


if __name__ == "__main__":
    main()
