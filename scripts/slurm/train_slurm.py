#!/usr/bin/env python
"""Train on Slurm: the Dask workers are Slurm jobs (dask-jobqueue's SLURMCluster), submitted with
``--requeue`` so a preempted one comes back; the scheduler runs in this process. Copy it and
change what your site needs (partition, account, walltime, the modules a job loads).

    pip install -e ".[slurm]"          # dask-jobqueue, on the login node
    python scripts/slurm/train_slurm.py --jobs 4 --gpu --partition gpu -- \\
        --data cifar10 --device gpu --strategy ipm --replicas 4 --epochs 30 --out runs/slurm

Everything after ``--`` is ``python -m pipeline train``'s flags (the script adds ``--scheduler``).
Every job runs ``python -m distributed.cli.dask_worker`` with this interpreter (``--python``), so
the nodes need this project installed at the same path (a shared filesystem) or in a container
image of the same version: tasks travel as references to our modules (docs/cluster.md).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

# The workers' preload (pipeline/cluster/worker_setup.py): the embedded cluster's log filters.
PRELOAD = ("--preload", "pipeline.cluster.worker_setup")


def worker_args(cores: int, gpu: bool) -> list[str]:
    """The flags each job's ``dask worker`` gets besides jobqueue's own (address, threads,
    memory, name): the preload, and the resource the pipeline places tasks by (docs/cluster.md,
    "Placement"): ``GPU=1`` for a GPU worker, ``CPU=cores`` for a CPU one.

    >>> worker_args(2, gpu=False)
    ['--preload', 'pipeline.cluster.worker_setup', '--resources', 'CPU=2']
    """
    return [*PRELOAD, "--resources", "GPU=1" if gpu else f"CPU={cores}"]


def slurm_cluster(*, cores: int = 1, memory: str = "4GB", gpu: bool = False,
                  partition: str | None = None, account: str | None = None,
                  walltime: str = "01:00:00", python: str | None = None,
                  interface: str | None = None, scheduler_host: str | None = None,
                  log_directory: str | None = None, prologue: Sequence[str] = (),
                  death_timeout: float = 60):
    """A ``SLURMCluster`` whose every job is one single-process Dask worker of ``cores`` threads
    (one thread per core: docs/cluster.md, "Why --nthreads 1"). ``interface`` (``ib0``,
    ``eth0``) or ``scheduler_host`` is where the workers reach this process's scheduler;
    ``prologue``: shell lines each job runs first (``module load cuda``, ``export ...``)."""
    from dask_jobqueue import SLURMCluster
    directives = ["--requeue"] + (["--gres=gpu:1"] if gpu else [])
    scheduler_options = {"host": scheduler_host} if scheduler_host else {}
    return SLURMCluster(
        queue=partition, account=account, cores=cores, processes=1, memory=memory,
        walltime=walltime, python=python or sys.executable, interface=interface,
        scheduler_options=scheduler_options, job_extra_directives=directives,
        worker_extra_args=worker_args(cores, gpu), job_script_prologue=list(prologue),
        log_directory=log_directory, death_timeout=death_timeout)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's flags, and the training flags after ``--``."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="after --: python -m pipeline train's flags")
    parser.add_argument("--jobs", type=int, default=2, help="Slurm jobs, one worker each")
    parser.add_argument("--cores", type=int, default=1, help="CPUs (threads) per job")
    parser.add_argument("--memory", default="4GB", help="memory per job")
    parser.add_argument("--gpu", action="store_true", help="one GPU per job (--gres=gpu:1)")
    parser.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    parser.add_argument("--account", help="Slurm account")
    parser.add_argument("--walltime", default="01:00:00", help="per job; HH:MM:SS")
    parser.add_argument("--interface", help="network interface the workers reach us on")
    parser.add_argument("--log-directory", default="slurm-logs", help="the jobs' output files")
    parser.add_argument("--wait", type=float, default=600,
                        help="seconds to wait for every job's worker before training")
    return parser.parse_args(argv[:cut]), argv[cut + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    from distributed import Client
    from pipeline.cli import main as pipeline_main
    args, train_args = parse(sys.argv[1:] if argv is None else argv)
    with slurm_cluster(cores=args.cores, memory=args.memory, gpu=args.gpu,
                       partition=args.partition, account=args.account,
                       walltime=args.walltime, interface=args.interface,
                       log_directory=args.log_directory) as cluster:
        print(cluster.job_script(), file=sys.stderr)
        cluster.scale(jobs=args.jobs)
        with Client(cluster) as client:  # start when all are up: a replica per worker from round 0
            client.wait_for_workers(args.jobs, timeout=args.wait)
        return pipeline_main(["train", "--scheduler", cluster.scheduler_address, *train_args])


if __name__ == "__main__":
    sys.exit(main())
