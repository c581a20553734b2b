"""The embedded cluster: a LocalCluster, or beside GPUs and loader workers a SpecCluster of
unlike workers (CPU, loader, one GPU worker per device, ranks), sized to what the machine holds,
closed quietly."""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import dask
import distributed
from dask.system import CPU_COUNT

from pipeline.cluster.resources import EMBEDDED, rank_resource
from pipeline.core.config_cluster import ClusterConfig, adapt_bounds
from pipeline.core.errors import ClusterError, one_line


class Roles(NamedTuple):
    """The resources an embedded cluster's CPU workers advertise: `load` (decode-/augment-
    tasks ask for it: `augment.resource`) and, beside loader workers, `train` (CPU train- and
    evaluate- tasks ask for it: `train.cpu_resource`)."""
    load: str = "CPU"
    train: str = "TRAIN"


# Distributed's housekeeping, less often than its defaults, on the cluster we start ourselves:
# every worker samples its running task's stack at 100 Hz for the dashboard's profile page (and
# takes the GIL to do it), and every server's event loop wakes at 50 Hz to time itself. On a
# machine whose every core trains a replica, those wakeups come out of the training: with these
# values `ipm` K=2 on two one-thread workers ran 1-8% more images/s in 4 of 4 alternated pairs
# of benchmarks/speedup.py (docs/benchmarks.md, "Two workers over one"); `single` on one worker,
# which leaves a core to them, did not change. The profile page still fills, at 10 samples/s.
QUIET = {
    "distributed.worker.profile.interval": "100ms",  # distributed's default: 10ms
    "distributed.admin.tick.interval": "1s",  # 20ms
    "distributed.admin.system-monitor.interval": "2s",  # 500ms
    "distributed.worker.memory.monitor-interval": "1s",  # 100ms
    "distributed.scheduler.work-stealing-interval": "1s",  # 100ms
}


def quiet_config() -> dict:
    """:data:`QUIET`'s values where the user's Dask config still holds distributed's own default
    (a value the user set stays theirs).

    >>> sorted(quiet_config()) == sorted(QUIET)  # nothing set here
    True
    """
    defaults = dask.config.merge(*dask.config.defaults)
    return {key: value for key, value in QUIET.items()
            if dask.config.get(key, None) == dask.config.get(key, None, config=defaults)}


def default_workers(threads_per_worker: int, gpu_workers: int = 0, loader_workers: int = 0) -> int:
    """Embedded CPU worker processes that fill the cores (affinity and cgroup aware) left over
    after one core per GPU worker and per loader worker.

    >>> default_workers(10**6)
    1
    """
    return max(1, (CPU_COUNT - gpu_workers - loader_workers) // threads_per_worker)


def threads_per_worker(cfg: ClusterConfig, replicas: int, kernels: str, gpus=()) -> int:
    """``cfg.threads_per_worker``, or when it is None (auto): 1 (one replica per one-thread
    worker: ``ipm`` K=2 on two one-thread workers ran 1.6-1.8x one), except for one replica on
    a CPU-only local cluster with our CPU kernels, whose train tasks then get all the cores in one
    worker: its kernels share them with the bits of one thread (``Backend.using_threads``;
    cifar10-2015 ``single`` 1.37x one thread on 2 cores in a run, docs/benchmarks.md).

    >>> threads_per_worker(ClusterConfig(threads_per_worker=3), 1, "ours")
    3
    >>> threads_per_worker(ClusterConfig(), 2, "ours")
    1
    """
    if cfg.threads_per_worker is not None:
        return cfg.threads_per_worker
    alone = (replicas == 1 and kernels == "ours" and not gpus and not cfg.workers
             and not cfg.loader_workers and not cfg.scheduler and not cfg.adapt)
    return max(1, CPU_COUNT) if alone else 1


def local_gpus() -> list[str]:
    """CUDA device ids an embedded cluster can give one GPU worker each; [] without GPUs.

    The entries of $CUDA_VISIBLE_DEVICES when it is set, else the indices `nvidia-smi -L` lists.
    Runs no CUDA code: a CUDA context in the driver would hold GPU memory for the whole run.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # no driver, or a hung one
        return []
    lines = out.stdout.splitlines() if out.returncode == 0 else []
    return [str(i) for i, _ in enumerate(line for line in lines if line.startswith("GPU "))]


@contextlib.contextmanager
def embedded_cluster(cfg: ClusterConfig, gpus: list[str],
                      roles: Roles) -> Iterator[distributed.Client]:
    from pipeline.cluster.blas import environ_kept
    with environ_kept():  # the nannies (in this process) set the kernel of --blas-kernel here
        try:
            cluster = _start_embedded(cfg, gpus, roles)
        except RuntimeError as exc:  # "Nanny failed to start": the worker processes died
            raise ClusterError(f"could not start the local cluster's worker processes: "
                               f"{one_line(exc, kind=False)} (a script that starts one needs "
                               f"`if __name__ == '__main__':` around it)") from exc
        EMBEDDED.add(cluster)
        # Client before cluster on the way out: the reverse order logs CommClosedError tracebacks.
        with _quiet_close(), cluster, distributed.Client(cluster) as client:
            yield client


class _SlowExitFilter(logging.Filter):
    """Drops the nanny's "Worker process still alive after 4.0 seconds, killing" while our own
    cluster closes: on a busy machine a worker takes longer to exit, and killing it then is the
    plan, not news (unfiltered, it prints after the run's last line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Worker process still alive after")


@contextlib.contextmanager
def _quiet_close() -> Iterator[None]:
    nanny, quiet = logging.getLogger("distributed.nanny"), _SlowExitFilter()
    nanny.addFilter(quiet)
    try:
        yield
    finally:
        nanny.removeFilter(quiet)


def _start_embedded(cfg: ClusterConfig, gpus: list[str], roles: Roles) -> distributed.SpecCluster:
    """The embedded cluster; its worker processes ignore SIGINT and SIGTERM (they inherit that from
    here), so a Ctrl-C to the terminal's process group reaches only the driver, which stops the
    run at a round boundary and then closes the workers itself."""
    from pipeline.cluster.blas import spawn_environ
    from pipeline.cluster.bokeh_validation import per_thread
    from pipeline.core.interrupt import signals_ignored
    per_thread()  # its scheduler's dashboard runs Bokeh on a thread of this process
    with signals_ignored(), warnings.catch_warnings(), \
            dask.config.set({**quiet_config(), **spawn_environ(cfg.blas_kernel)}):  # read as
        # the scheduler and the nannies start; each worker process gets the nanny's copy
        # "Port 8787 is already in use ... Hosting the HTTP server on port N instead": the
        # summary line gives the link that was bound.
        warnings.filterwarnings("ignore", message=".*already in use", category=UserWarning)
        return _new_embedded(cfg, gpus, roles)


WORKER_BYTES = 256 << 20  # an idle worker process with NumPy, Chainer and distributed: ~200 MB
PROCESSES_PER_CORE = 4  # beyond this the workers only take turns (and each still costs memory)


def capacity(cores: int, available: int) -> int:
    """Worker processes a machine of ``cores`` cores and ``available`` bytes of free memory can
    hold: at most 4 a core, and ~256 MiB each.

    >>> capacity(2, 16 << 30), capacity(64, 1 << 30)
    (8, 4)
    """
    return max(1, min(PROCESSES_PER_CORE * cores, available // WORKER_BYTES))


def available_memory() -> int:
    """Bytes of memory free for new processes (the cgroup's limit where it is lower)."""
    import psutil
    from distributed.system import MEMORY_LIMIT
    return int(min(psutil.virtual_memory().available, MEMORY_LIMIT))


def check_capacity(processes: int, cores: int = CPU_COUNT, available: int | None = None) -> None:
    """ClusterError when the embedded cluster would start more worker processes than the machine
    holds (:func:`capacity`), before one starts: asked for 1024 on 2 cores, processes start
    until the kernel kills them."""
    available = available_memory() if available is None else available
    most = capacity(cores, available)
    if processes > most:
        raise ClusterError(
            f"cluster.workers: {processes} worker processes are more than this machine holds: "
            f"{cores} core(s) and {available / (1 << 30):.1f} GiB of free memory hold at most "
            f"{most} (up to {PROCESSES_PER_CORE} a core, ~{WORKER_BYTES >> 20} MiB each); give "
            f"--workers {most} or fewer, or --scheduler ADDR of a larger cluster")


def _new_embedded(cfg: ClusterConfig, gpus: list[str], roles: Roles) -> distributed.SpecCluster:
    threads, loaders = cfg.threads_per_worker or 1, cfg.loader_workers
    n_cpu = cfg.workers or default_workers(threads, len(gpus), loaders)
    bounds = adapt_bounds(cfg.adapt) if cfg.adapt else None
    if bounds is not None and gpus:
        raise ClusterError(f"cluster.adapt {cfg.adapt}: adaptive scaling starts CPU workers "
                           f"only; this machine's GPUs ({len(gpus)}) need fixed GPU workers: "
                           "give --workers N, or CUDA_VISIBLE_DEVICES= to train on the CPU")
    n_cpu = bounds[0] if bounds else n_cpu
    check_capacity((bounds[1] if bounds else n_cpu) + loaders +
                   len(gpus) * cfg.gpu_workers_per_device)
    if not gpus and not loaders:
        cluster = distributed.LocalCluster(
            n_workers=n_cpu, threads_per_worker=threads, processes=True, host="127.0.0.1",
            dashboard_address=cfg.dashboard_address, resources={roles.load: threads},
            preload=_worker_preloads())
        if bounds is not None:
            cluster.adapt(Adaptive=ReplicaAdaptive, minimum=bounds[0], maximum=bounds[1])
        return cluster
    # Unlike workers: LocalCluster gives all workers the same options, SpecCluster one spec each.
    # Beside loaders the CPU workers train, unless GPU workers do (then they load as well).
    # The training workers are ranks (`rank_resource`): replica k's train- tasks can be held to
    # one of them by resource, which a worker without the train resource cannot take.
    cpu_trains = bool(loaders and not gpus)
    cpu_role = roles.train if cpu_trains else roles.load
    common = {"host": "127.0.0.1", "silence_logs": logging.WARN, "dashboard": False,
              "preload": _worker_preloads()}
    specs = {f"cpu-{i}": {"cls": distributed.Nanny, "options": {
        **common, "nthreads": threads, "resources": {
            cpu_role: threads, **({rank_resource(i): threads} if cpu_trains else {})}}}
        for i in range(n_cpu)}
    specs.update({f"loader-{i}": {"cls": distributed.Nanny, "options": {
        **common, "nthreads": 1, "resources": {roles.load: 1}}} for i in range(loaders)})
    per_device, gpu_threads = cfg.gpu_workers_per_device, cfg.gpu_threads
    gpu_workers = [(d, j) for d in gpus for j in range(per_device)]
    specs.update({f"gpu-{d}" + (f"-{j}" if per_device > 1 else ""): {
        "cls": distributed.Nanny, "options": {
            **common, "nthreads": gpu_threads,
            "resources": {"GPU": gpu_threads, rank_resource(rank): gpu_threads},
            "env": {"CUDA_VISIBLE_DEVICES": d}}}
        for rank, (d, j) in enumerate(gpu_workers)})
    scheduler = {"cls": distributed.Scheduler, "options": {
        "host": "127.0.0.1", "port": 0, "dashboard": True,
        "dashboard_address": cfg.dashboard_address}}
    return distributed.SpecCluster(workers=specs, scheduler=scheduler, silence_logs=logging.WARN)


# The train- task states that mean a run is training a replica: submitted and not done (a round
# submitted one ahead waits on its inputs), or its result held for the next round.
TRAINING = ("waiting", "queued", "no-worker", "processing", "memory")


def training_replicas(tasks) -> int:
    """Replicas with a train- task among the scheduler's ``TaskState``s ``tasks`` that is not
    done or whose result is held (:data:`TRAINING`).

    >>> from types import SimpleNamespace as T
    >>> training_replicas([T(key=("train-0123abcd", 4, k, "params"), state="waiting")
    ...                    for k in range(3)] + [T(key=("train-0123abcd", 3, 3), state="released")])
    3
    """
    from pipeline.core.keys import train_replica
    return len({train_replica(ts.key) for ts in tasks if ts.state in TRAINING} - {None})


class ReplicaAdaptive(distributed.Adaptive):
    """Dask's adaptive scaling (``--adapt MIN:MAX``), its target raised to the replicas a run
    is training (one one-thread worker each, as placement wants them): Dask's own (pending
    tasks' expected run time over 5 s) wanted one worker for a whole run of small rounds (ipm
    K=3, small-cnn: each task ~0.1 s), so replicas waiting for a busy worker never got one of
    their own. Counted from the train- tasks the scheduler holds, so a driver busy between
    rounds (a checkpoint, a slow hook) keeps the target; once a run is over none are left and
    Dask's target scales the cluster down."""

    async def target(self) -> int:
        ours = training_replicas(self.cluster.scheduler.tasks.values())  # same event loop
        return max(await super().target(), min(ours, self.maximum))


def _worker_preloads() -> list[str]:
    """The user's configured worker preloads, then ours (`pipeline.cluster.worker_setup`)."""
    configured = dask.config.get("distributed.worker.preload") or []
    return [*configured, "pipeline.cluster.worker_setup"]


def check_dashboard_host(address: str) -> None:
    """ClusterError when the host of ``cluster.dashboard_address`` (``HOST:PORT`` or ``:PORT``)
    does not resolve (distributed's own error blamed a missing ``__main__`` guard).

    >>> check_dashboard_host(":8787"); check_dashboard_host("127.0.0.1:0")
    """
    import socket
    host = address.rsplit(":", 1)[0] if ":" in address else address
    host = host.strip("[]")
    if not host:
        return
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as exc:
        raise ClusterError(f"cluster.dashboard_address {address}: cannot resolve host {host!r} "
                           f"({one_line(exc, kind=False)})") from None
