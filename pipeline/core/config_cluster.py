"""The config section of where it runs: ``cluster`` (a local cluster's workers or a scheduler's
address, TLS, placement, the BLAS kernel, the stalled-task watchdog)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.core.fields import check, check_types, in_range, opt

DAY_S = 86_400.0  # longest timeout: a day
_KERNEL = re.compile(r"^[A-Za-z][A-Za-z0-9_]{1,31}$")  # an OPENBLAS_CORETYPE value


def dashboard_port(address: str) -> int | None:
    """The port of a dashboard address (``HOST:PORT``, ``:PORT``, ``PORT``, ``[v6]:PORT``), or
    None when it has none in [0, 65535].

    >>> dashboard_port("127.0.0.1:8787"), dashboard_port(":0"), dashboard_port(":99999")
    (8787, 0, None)
    """
    if not isinstance(address, str):
        return None
    port = address.rpartition(":")[2]
    if not (port.isascii() and port.isdigit() and len(port) <= 5):
        return None
    return int(port) if int(port) <= 65535 else None


def adapt_bounds(text: str) -> tuple[int, int] | None:
    """``(minimum, maximum)`` workers of a ``cluster.adapt`` value ``MIN:MAX``, or None when it
    is not one with 1 <= MIN <= MAX <= 1024.

    >>> adapt_bounds("1:3"), adapt_bounds("3:1"), adapt_bounds("0:2"), adapt_bounds("x")
    ((1, 3), None, None, None)
    """
    match = re.fullmatch(r"(\d{1,4}):(\d{1,4})", text) if isinstance(text, str) else None
    if match is None:
        return None
    low, high = int(match[1]), int(match[2])
    return (low, high) if 1 <= low <= high <= 1024 else None


@dataclass(frozen=True)
class ClusterConfig:
    scheduler: str | None = opt(None, "a running dask scheduler (tcp://HOST:PORT) instead of a "
                                "local cluster; also $DASK_SCHEDULER_ADDRESS", flag="--scheduler",
                                metavar="ADDRESS", none="none: a local cluster")
    workers: int | None = opt(None, "local cluster: CPU worker processes", flag="--workers",
                              metavar="N", none="the cores that GPU and loader workers leave, "
                              "over --threads-per-worker")
    # Elastic runs: pipeline.training.elastic places the replicas again where workers changed.
    adapt: str | None = opt(None, "local cluster: Dask's adaptive scaling between MIN and MAX "
                            "one-thread CPU worker processes (a worker that joins trains from "
                            "the next round; one scaled down hands its replicas over)",
                            flag="--adapt", metavar="MIN:MAX",
                            none="a fixed number of workers (--workers)")
    threads_per_worker: int | None = opt(None, "local cluster: threads per worker process (a "
                                         "train task gets its worker's threads over the "
                                         "replicas placed there)", flag="--threads-per-worker",
                                         metavar="N", unit="threads",
                                         none="1, or all the cores in one worker for one "
                                         "replica on CPU with our kernels")
    dashboard_address: str = opt("127.0.0.1:8787", "local cluster: where its dashboard listens "
                                 "(port 0: any free port; a busy port falls back to a free one)",
                                 flag="--dashboard-address", metavar="HOST:PORT")
    tls_ca_file: str | None = opt(None, "TLS: CA certificate that signed the scheduler and "
                                  "workers", flag="--tls-ca-file", metavar="PEM")
    tls_cert: str | None = opt(None, "TLS: this client's certificate", flag="--tls-cert",
                               metavar="PEM")
    tls_key: str | None = opt(None, "TLS: this client's private key", flag="--tls-key",
                              metavar="PEM")
    connect_timeout: float = opt(10.0, "how long to wait for the scheduler and its workers",
                                 flag="--connect-timeout", metavar="SECONDS", unit="s")
    resource_timeout: float = opt(5.0, "how long to wait for a worker with a needed resource",
                                  unit="s")
    # Unpinned, the scheduler stacks replicas on one worker in some rounds (placement.py).
    pin_replicas: bool = opt(True, "replica k's train- tasks prefer worker k mod W (sorted by "
                             "name; beside loader or CPU workers, by the RANK-i resource of a "
                             "ranked worker), as a rank stays on its device; off: the scheduler "
                             "places them", flag="--pin-replicas")
    gpu_workers_per_device: int = opt(1, "local cluster: GPU worker processes per device (the "
                                      "replicas share it by time-slicing; benchmarks/gpu.py)",
                                      flag="--gpu-workers-per-device", metavar="N",
                                      unit="workers")
    gpu_threads: int = opt(1, "local cluster: threads per GPU worker (concurrent train- tasks in "
                           "one process and CUDA context)", flag="--gpu-threads", metavar="N",
                           unit="threads")
    loader_workers: int = opt(0, "local cluster: one-thread worker processes that only decode "
                              "and augment; the CPU workers then only train "
                              "(--cpu-resource)", flag="--loader-workers", metavar="N",
                              unit="workers")
    # OpenBLAS kernels add in different orders: other bits on another kind of CPU
    # (docs/reliability.md); pipeline.cluster.blas.
    blas_kernel: str | None = opt(None, "OpenBLAS kernel every worker runs (OPENBLAS_CORETYPE: "
                                  "Haswell, SkylakeX, Sandybridge, Zen, ...), so a cluster of "
                                  "mixed CPUs gives one answer: the local cluster's workers "
                                  "start with it, an external cluster's nannies restart theirs",
                                  flag="--blas-kernel", metavar="KERNEL",
                                  none="each worker's own; a warning when they differ")
    # The stalled-task watchdog: pipeline.cluster.watchdog.
    stall_report: float = opt(5.0, "report a task running X times its finished peers' median "
                              "(and at least --stall-min-seconds)", flag="--stall-report",
                              metavar="X", unit="x")
    stall_retire: float = opt(20.0, "retire the worker of a task running X times its peers' "
                              "median, so its work is replayed elsewhere (0: never)",
                              flag="--stall-retire", metavar="X", unit="x")
    stall_min_s: float = opt(60.0, "a task may always run this long before it is reported "
                             "(--stall-retire / --stall-report times as long before its worker is "
                             "retired); a task its worker is not computing is assigned again "
                             "after this long", flag="--stall-min-seconds", metavar="SECONDS",
                             unit="s")

    def validate(self) -> None:
        check_types(self, "cluster.")
        check(self.workers is None or 1 <= self.workers <= 1024, "cluster.workers",
               "must be in [1, 1024]", self.workers)
        check(self.adapt is None or adapt_bounds(self.adapt) is not None, "cluster.adapt",
              "must be MIN:MAX with 1 <= MIN <= MAX <= 1024", self.adapt)
        for other, given in (("scheduler", self.scheduler), ("workers", self.workers),
                             ("loader_workers", self.loader_workers)):
            check(self.adapt is None or not given, "cluster.adapt",
                  f"sizes the local cluster itself: give it without cluster.{other}", self.adapt)
        check(self.threads_per_worker is None or 1 <= self.threads_per_worker <= 1024,
              "cluster.threads_per_worker", "must be in [1, 1024]", self.threads_per_worker)
        tls = (self.tls_ca_file, self.tls_cert, self.tls_key)
        check(all(tls) or not any(tls), "cluster.tls", "needs all of ca file, cert and key", tls)
        in_range(self.connect_timeout, 0, DAY_S, "cluster.connect_timeout", closed_lo=False)
        in_range(self.resource_timeout, 0, DAY_S, "cluster.resource_timeout")
        check(1 <= self.gpu_workers_per_device <= 64, "cluster.gpu_workers_per_device",
               "must be in [1, 64]", self.gpu_workers_per_device)
        check(1 <= self.gpu_threads <= 64, "cluster.gpu_threads", "must be in [1, 64]",
               self.gpu_threads)
        check(0 <= self.loader_workers <= 1024, "cluster.loader_workers", "must be in [0, 1024]",
               self.loader_workers)
        in_range(self.stall_report, 1, 1e6, "cluster.stall_report")
        check(self.stall_retire == 0 or self.stall_report <= self.stall_retire <= 1e6,
               "cluster.stall_retire", "must be 0 (never) or in [cluster.stall_report, 1e6]",
               self.stall_retire)
        in_range(self.stall_min_s, 0, DAY_S, "cluster.stall_min_s")
        check(dashboard_port(self.dashboard_address) is not None, "cluster.dashboard_address",
              "must be HOST:PORT, :PORT or PORT with a port in [0, 65535] (0: any free port)",
              self.dashboard_address)
        check(self.blas_kernel is None or bool(_KERNEL.match(self.blas_kernel)),
              "cluster.blas_kernel", "must be an OpenBLAS kernel name (Haswell, SkylakeX, ...)",
              self.blas_kernel)
