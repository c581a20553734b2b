"""A fixed set of short runs whose final weights are printed as digests (one JSON line).

Run as a script with any ``pipeline`` first on ``sys.path`` (``PYTHONPATH``): the restructure
test runs it against the tree before the move and against this one and compares the digests.
Uses only ``pipeline.Config`` and ``pipeline.train``, the public API both trees have.
"""
import hashlib
import json

import numpy as np

BASE = {"data.source": "synthetic:256:64", "model.name": "small-cnn", "train.batch_size": 16,
        "train.epochs": 1, "train.lr": 0.01, "augment.policy": "cifar", "progress": False,
        "checkpoint_every": 0, "seed": 5, "train.replicas": 2, "average.mix_every": "4"}
RUNS = {"ipm": {"train.strategy": "ipm"},
        "gradient": {"train.strategy": "gradient", "train.epochs": 0.5},
        "async": {"train.strategy": "async", "asynchronous.order": "fixed"},
        "resnet20": {"train.strategy": "single", "train.replicas": 1, "model.name": "resnet20",
                     "train.epochs": 0.25}}  # BatchNorm: persistent values in the state


def digest(params: dict) -> str:
    """sha256 over the sorted names and the bytes of every array."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(np.ascontiguousarray(params[name]).tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    import distributed
    from threadpoolctl import threadpool_limits

    from pipeline import Config, train
    threadpool_limits(1)
    digests = {}
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address="127.0.0.1:0") as cluster, \
            distributed.Client(cluster) as client:
        for name, changes in RUNS.items():
            result = train(Config().replace(**{**BASE, **changes}), client=client,
                           log=lambda message: None)
            digests[name] = digest(result.params)
    print(json.dumps(digests))


if __name__ == "__main__":
    main()
