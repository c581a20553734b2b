"""Benchmark: what the optional run logs cost per round: TensorBoard (tensorboardX) and CSV.

Writes ``--rounds`` metrics lines (the 11 scalars of a round, stage seconds included) through the
run-output hooks of ``pipeline.outputs.hooks`` into a temporary directory and reports microseconds per
round, and the one-time import of tensorboardX. A round of the smallest test run takes ~100 ms.

    .venv/bin/python benchmarks/logwriters.py               # a few seconds
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import _common  # noqa: F401  (makes the repo importable)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    args = parser.parse_args()
    start = time.perf_counter()
    import tensorboardX  # noqa: F401
    import_s = time.perf_counter() - start
    from pipeline import Config
    from pipeline.outputs.hooks import CSVLog, RunInfo, TensorBoardLog, scalars
    stages = ("load", "augment", "train", "average", "evaluate", "waiting")
    line = {"round": 0, "epoch": 0, "epoch_float": 0.1, "step": 1, "train_loss": 2.3,
            "train_acc": 0.1, "test_loss": 2.3, "test_acc": 0.1, "lr": 0.01, "images": 128,
            "seconds": 1.0, "stage_seconds": {s: 0.1 for s in stages}, "bytes_averaged": 1000}
    info = RunInfo(None, Config(), None, [], 10, 10, "synthetic", [], print)
    result = {"rounds": args.rounds, "scalars_per_round": len(scalars(line)),
              "tensorboardx_import_s": round(import_s, 3)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, hook in (("tensorboard", TensorBoardLog(f"{tmp}/tb")),
                           ("csv", CSVLog(f"{tmp}/metrics.csv"))):
            hook.start(info)
            start = time.perf_counter()
            for r in range(args.rounds):
                hook(dict(line, round=r, step=r))
            getattr(hook, "close", lambda: None)()
            result[f"{name}_us_per_round"] = round(
                (time.perf_counter() - start) / args.rounds * 1e6, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
