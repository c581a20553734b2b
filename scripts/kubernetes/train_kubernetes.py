#!/usr/bin/env python
"""Train on Kubernetes: dask-kubernetes' operator starts the scheduler and worker pods of
scripts/kubernetes/daskcluster.yaml (rendered with your image, worker count, GPU or CPU workers),
this process trains on them and the cluster is deleted at the end. Copy it and change what your
site needs (namespace, node selectors, volumes for the data).

    pip install -e ".[kubernetes]"      # dask-kubernetes, where kubectl works
    python scripts/kubernetes/train_kubernetes.py --image registry.example.com/dask-chainer-pipeline:0.1.0 \\
        --workers 4 -- --data synthetic --device gpu --strategy ipm --replicas 4 --epochs 30

Everything after ``--`` is ``python -m pipeline train``'s flags (the script adds ``--scheduler``).
``--render`` prints the manifest instead (``| kubectl apply -f -``).
"""
from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from pathlib import Path

MANIFEST = Path(__file__).with_name("daskcluster.yaml")


def worker_args(gpu: bool, threads: int) -> list[str]:
    """The worker container's command: one Dask worker of ``threads`` threads with our preload,
    advertising ``GPU=1`` (a GPU worker) or ``TRAIN=threads`` (a CPU worker: CPU train- and
    evaluate- tasks go there; docs/cluster.md, "Placement")."""
    return ["dask", "worker", "--name", "$(DASK_WORKER_NAME)", "--nthreads", str(threads),
            "--resources", "GPU=1" if gpu else f"TRAIN={threads}",
            "--preload", "pipeline.cluster.worker_setup",
            "--dashboard", "--dashboard-address", "8788"]


def render(image: str | None = None, workers: int | None = None, gpu: bool = True,
           threads: int = 1, memory: str | None = None, name: str | None = None) -> dict:
    """scripts/kubernetes/daskcluster.yaml as a dict, with the changes asked for; a CPU worker
    asks for ``threads`` cores and no ``nvidia.com/gpu``."""
    import yaml
    spec = copy.deepcopy(yaml.safe_load(MANIFEST.read_text()))
    if name:
        spec["metadata"]["name"] = name
        spec["spec"]["scheduler"]["service"]["selector"]["dask.org/cluster-name"] = name
    if workers is not None:
        spec["spec"]["worker"]["replicas"] = workers
    pods = (spec["spec"]["worker"]["spec"], spec["spec"]["scheduler"]["spec"])
    for container in (c for pod in pods for c in pod["containers"]):
        container["image"] = image or container["image"]
    worker = spec["spec"]["worker"]["spec"]["containers"][0]
    worker["args"] = worker_args(gpu, threads)
    resources = worker["resources"]
    if not gpu:
        resources["limits"].pop("nvidia.com/gpu", None)
        resources["requests"]["cpu"] = str(threads)
    if memory:
        resources["requests"]["memory"] = resources["limits"]["memory"] = memory
    return spec


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's flags, and the training flags after ``--``."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="after --: python -m pipeline train's flags")
    parser.add_argument("--image", help="this project's image (scripts/kubernetes/Dockerfile)")
    parser.add_argument("--workers", type=int, default=2, help="worker pods")
    parser.add_argument("--cpu", action="store_true", help="CPU workers (no GPU asked for)")
    parser.add_argument("--threads", type=int, default=1, help="threads (cores) per CPU worker")
    parser.add_argument("--memory", help="memory per worker pod (8Gi)")
    parser.add_argument("--name", default="pipeline", help="the DaskCluster's name")
    parser.add_argument("--namespace", help="Kubernetes namespace (default: the context's)")
    parser.add_argument("--render", action="store_true", help="print the manifest and exit")
    return parser.parse_args(argv[:cut]), argv[cut + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    args, train_args = parse(sys.argv[1:] if argv is None else argv)
    spec = render(args.image, args.workers, gpu=not args.cpu, threads=args.threads,
                  memory=args.memory, name=args.name)
    if args.render:
        import yaml
        print(yaml.safe_dump(spec, sort_keys=False), end="")
        return 0
    from dask_kubernetes.operator import KubeCluster
    from distributed import Client
    from pipeline.cli import main as pipeline_main
    with KubeCluster(custom_cluster_spec=spec, namespace=args.namespace) as cluster:
        with Client(cluster) as client:  # start when all are up: a replica per worker from round 0
            client.wait_for_workers(args.workers, timeout=600)
        return pipeline_main(["train", "--scheduler", cluster.scheduler_address, *train_args])


if __name__ == "__main__":
    sys.exit(main())
