"""Connecting to Dask: an embedded LocalCluster or an external scheduler (TLS), worker resources, fail-fast checks."""
from __future__ import annotations

import contextlib
import logging
import os
import stat
import subprocess
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import dask
import distributed
from dask.system import CPU_COUNT
from distributed.security import Security

from pipeline.core.config_cluster import ClusterConfig
from pipeline.core.errors import ClusterError, one_line
from pipeline.core.threads import limit_blas_threads, worker_threads  # noqa: F401 (one home: threads)

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often require_* ask the scheduler again; a scheduler_info round trip is ~1 ms
_TLS_FIELDS = (("tls_ca_file", "--tls-ca-file"), ("tls_cert", "--tls-cert"), ("tls_key", "--tls-key"))
_EMBEDDED: weakref.WeakSet = weakref.WeakSet()  # clusters connect() started: they never gain workers


class Roles(NamedTuple):
    """The resources an embedded cluster's CPU workers advertise: `load` (decode-/augment-
    tasks ask for it: `augment.resource`) and, beside loader workers, `train` (CPU train- and
    evaluate- tasks ask for it: `train.cpu_resource`)."""
    load: str = "CPU"
    train: str = "TRAIN"


TLS_FILE_BYTES = 1 << 20  # a PEM certificate chain or key is a few KiB


def _check_tls_file(path: str, field: str) -> None:
    """ClusterError unless ``path`` is a regular file of at most 1 MiB: the ssl module reads it
    with a plain open (a FIFO would block it forever, a sparse terabyte take hours)."""
    from pipeline.core.files import describe
    try:
        st = os.stat(path)
    except OSError:
        raise ClusterError(f"{field}: no such file {path!r}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ClusterError(f"{field}: {path!r} is {describe(st.st_mode)}, expected a regular file")
    if st.st_size > TLS_FILE_BYTES:
        raise ClusterError(f"{field}: {path!r} holds {st.st_size} bytes, more than a PEM file "
                           f"(at most {TLS_FILE_BYTES})")


def security_from(cfg: ClusterConfig) -> Security | None:
    """The client's TLS `Security` from the cluster section, or None when no TLS file is given.

    Encryption is required once TLS is configured, so a plain tcp:// address is refused rather
    than silently used.

    >>> security_from(ClusterConfig()) is None
    True
    >>> security_from(ClusterConfig(tls_ca_file="/nope/ca.pem", tls_cert="c.pem", tls_key="k.pem"))
    Traceback (most recent call last):
    ...
    pipeline.core.errors.ClusterError: cluster.tls_ca_file (--tls-ca-file): no such file '/nope/ca.pem'
    """
    paths = {name: getattr(cfg, name) for name, _ in _TLS_FIELDS}
    if not any(paths.values()):
        return None
    for name, flag in _TLS_FIELDS:
        path = paths[name]
        if not path:
            raise ClusterError(f"cluster.{name} ({flag}) is required with the other TLS files")
        _check_tls_file(path, f"cluster.{name} ({flag})")
    return Security(tls_ca_file=paths["tls_ca_file"], tls_client_cert=paths["tls_cert"],
                    tls_client_key=paths["tls_key"], require_encryption=True)


def scheduler_address(cfg: ClusterConfig) -> str | None:
    """The external scheduler to use: `cfg.scheduler`, else $DASK_SCHEDULER_ADDRESS, else None.

    >>> scheduler_address(ClusterConfig(scheduler="tcp://10.0.0.5:8786"))
    'tcp://10.0.0.5:8786'
    """
    return cfg.scheduler or os.environ.get("DASK_SCHEDULER_ADDRESS") or None


def default_workers(threads_per_worker: int, gpu_workers: int = 0, loader_workers: int = 0) -> int:
    """Embedded CPU worker processes that fill the cores (affinity and cgroup aware) left over
    after one core per GPU worker and per loader worker.

    >>> default_workers(10**6)
    1
    """
    return max(1, (CPU_COUNT - gpu_workers - loader_workers) // threads_per_worker)


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
def connect(cfg: ClusterConfig, log: Callable[[str], None] | None = None, *,
            min_workers: int = 1, gpus: Sequence[str] = (), roles: Roles = Roles()
            ) -> Iterator[distributed.Client]:
    """A Client for the run: an external scheduler when one is given, else an embedded cluster.

    External (`cfg.scheduler` or $DASK_SCHEDULER_ADDRESS): waits at most `cfg.connect_timeout` s
    for the scheduler and then for `min_workers` workers, raising ClusterError otherwise.
    Embedded: `cfg.workers` processes (default: `default_workers`) on 127.0.0.1, each with
    `cfg.threads_per_worker` threads advertising `CPU=threads_per_worker`, plus one single-thread
    worker per device id in `gpus` (e.g. `local_gpus()`) advertising `GPU=1` and seeing only its
    device (CUDA_VISIBLE_DEVICES); dashboard on `cfg.dashboard_address`. With
    `cfg.loader_workers` N, N more single-thread workers advertise only `CPU=1` (they decode and
    augment) and, without GPU workers, the CPU workers advertise `TRAIN=threads_per_worker`
    instead (they train): `roles` names the two resources. Beside loaders or CPU workers the
    training workers also advertise `RANK-i` (`rank_resource`). `gpus` and the loaders are
    ignored with an external scheduler: its workers advertise their own resources. `log` (default: this
    module's logger) gets one line with the scheduler, workers, resources and dashboard link.
    Everything this opens is closed on exit, also on errors.
    """
    log = log or logger.info
    address = scheduler_address(cfg)
    security = security_from(cfg)
    if address is None:
        if security is not None:
            raise ClusterError("--tls-ca-file/--tls-cert/--tls-key need --scheduler tls://HOST:PORT; "
                               "the embedded LocalCluster listens on 127.0.0.1 without TLS")
        if cfg.dashboard_address:
            check_dashboard_host(cfg.dashboard_address)
        with _embedded_cluster(cfg, list(gpus), roles) as client:
            log(_summary_line("started local cluster", client))
            yield client
        return
    with _external_client(address, security, cfg.connect_timeout) as client:
        require_workers(client, min_workers, cfg.connect_timeout)
        log(_summary_line("connected to", client))
        yield client


@contextlib.contextmanager
def _embedded_cluster(cfg: ClusterConfig, gpus: list[str],
                      roles: Roles) -> Iterator[distributed.Client]:
    from pipeline.cluster.blas import environ_kept
    with environ_kept():  # the nannies (in this process) set the kernel of --blas-kernel here
        try:
            cluster = _start_embedded(cfg, gpus, roles)
        except RuntimeError as exc:  # "Nanny failed to start": the worker processes died
            raise ClusterError(f"could not start the local cluster's worker processes: "
                               f"{one_line(exc, kind=False)} (a script that starts one needs "
                               f"`if __name__ == '__main__':` around it)") from exc
        _EMBEDDED.add(cluster)
        # Client before cluster on the way out: the reverse order logs CommClosedError tracebacks.
        with _quiet_close(), cluster, distributed.Client(cluster) as client:
            yield client


class _SlowExitFilter(logging.Filter):
    """Drops the nanny's "Worker process still alive after 4.0 seconds, killing" while our own
    cluster closes: on a busy machine a worker takes longer to exit, and killing it then is the
    plan, not news (it printed after the run's last line)."""

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
    from pipeline.core.interrupt import signals_ignored
    with signals_ignored(), warnings.catch_warnings(), \
            dask.config.set(spawn_environ(cfg.blas_kernel)):  # nannies read it as they start
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
    holds (:func:`capacity`), before one starts: 1024 on 2 cores started until the kernel
    killed them."""
    available = available_memory() if available is None else available
    most = capacity(cores, available)
    if processes > most:
        raise ClusterError(
            f"cluster.workers: {processes} worker processes are more than this machine holds: "
            f"{cores} core(s) and {available / (1 << 30):.1f} GiB of free memory hold at most "
            f"{most} (up to {PROCESSES_PER_CORE} a core, ~{WORKER_BYTES >> 20} MiB each); give "
            f"--workers {most} or fewer, or --scheduler ADDR of a larger cluster")


def _new_embedded(cfg: ClusterConfig, gpus: list[str], roles: Roles) -> distributed.SpecCluster:
    threads, loaders = cfg.threads_per_worker, cfg.loader_workers
    n_cpu = cfg.workers or default_workers(threads, len(gpus), loaders)
    check_capacity(n_cpu + loaders + len(gpus) * cfg.gpu_workers_per_device)
    if not gpus and not loaders:
        return distributed.LocalCluster(
            n_workers=n_cpu, threads_per_worker=threads, processes=True, host="127.0.0.1",
            dashboard_address=cfg.dashboard_address, resources={roles.load: threads},
            preload=_worker_preloads())
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


RANK = "RANK-"  # prefix of the resource that names a training worker's rank: RANK-0, RANK-1, ...


def rank_resource(rank: int) -> str:
    """The resource a training worker of rank `rank` advertises (as much as its train resource):
    `dask worker ADDR --resources "GPU=1,RANK-0=1"` on an external cluster.

    >>> rank_resource(3)
    'RANK-3'
    """
    return f"{RANK}{rank}"


def worker_ranks(resources: dict[str, dict[str, float]]) -> dict[int, str]:
    """{rank: worker address} of the workers that advertise a `RANK-i` resource.

    >>> worker_ranks({"tcp://a:1": {"GPU": 1, "RANK-1": 1}, "tcp://b:2": {"CPU": 2},
    ...               "tcp://c:3": {"GPU": 1, "RANK-0": 1}})
    {0: 'tcp://c:3', 1: 'tcp://a:1'}
    """
    ranks = {}
    for addr, res in resources.items():
        for name, amount in res.items():
            if name.startswith(RANK) and name[len(RANK):].isdigit() and amount > 0:
                ranks[int(name[len(RANK):])] = addr
    return dict(sorted(ranks.items()))


def _worker_preloads() -> list[str]:
    """The user's configured worker preloads, then ours (`pipeline.cluster.worker_setup`)."""
    configured = dask.config.get("distributed.worker.preload") or []
    return [*configured, "pipeline.cluster.worker_setup"]


def has_ucx() -> bool:
    """Whether a UCX transport for distributed is installed (ucx-py or distributed-ucxx)."""
    import importlib.util
    return any(importlib.util.find_spec(m) is not None for m in ("ucp", "distributed_ucxx"))


def check_protocol(address: str) -> None:
    """ClusterError when ``address`` names a transport this installation cannot speak: an
    unknown one, or ``ucx://`` without UCX (distributed then failed with a ``TypeError`` about
    an abstract class).

    >>> check_protocol("tcp://h:1"); check_protocol("h:1")
    >>> check_protocol("udp://h:1")
    Traceback (most recent call last):
    pipeline.core.errors.ClusterError: scheduler udp://h:1: unknown protocol 'udp' (tcp://, tls://, ws://, wss:// or ucx://)
    """
    scheme = address.split("://", 1)[0].lower() if "://" in address else "tcp"
    if scheme not in ("tcp", "tls", "ws", "wss", "ucx", "inproc"):
        raise ClusterError(f"scheduler {address}: unknown protocol {scheme!r} (tcp://, tls://, "
                           "ws://, wss:// or ucx://)")
    if scheme == "ucx" and not has_ucx():
        raise ClusterError(f"scheduler {address}: UCX is not installed here (ucx-py or "
                           "distributed-ucxx); connect with tcp:// or tls:// instead")


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


@contextlib.contextmanager
def _external_client(address: str, security: Security | None,
                     timeout: float) -> Iterator[distributed.Client]:
    address = _with_protocol(address, security)
    check_protocol(address)
    try:
        client = distributed.Client(address, security=security, timeout=timeout)
    except (OSError, RuntimeError, ValueError) as exc:  # OSError covers TimeoutError and refusals
        raise ClusterError(f"cannot reach scheduler at {address} within {timeout:g} s: "
                           f"{one_line(exc, kind=False)}") from None
    with client:
        yield client


def _with_protocol(address: str, security: Security | None) -> str:
    """Default a bare HOST:PORT to tls:// under TLS; refuse an explicit non-TLS protocol then.

    >>> _with_protocol("127.0.0.1:8786", Security(require_encryption=True))
    'tls://127.0.0.1:8786'
    >>> _with_protocol("127.0.0.1:8786", None)
    '127.0.0.1:8786'
    """
    if security is None:
        if address.startswith("tls://"):
            raise ClusterError(f"scheduler {address} uses TLS: give --tls-ca-file, --tls-cert and "
                               "--tls-key")
        return address
    if "://" not in address:
        return "tls://" + address
    if not address.startswith("tls://"):
        raise ClusterError(f"TLS files given but scheduler address {address} is not tls://")
    return address


def worker_resources(client: distributed.Client) -> dict[str, dict[str, float]]:
    """{worker address: {resource name: amount}} for every connected worker ({} when none)."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return {addr: dict(info.get("resources") or {}) for addr, info in workers.items()}


def has_resource(client: distributed.Client, name: str) -> bool:
    """Whether some connected worker advertises a positive amount of resource `name`."""
    return any(res.get(name, 0) > 0 for res in worker_resources(client).values())


def require_resource(client: distributed.Client, name: str, timeout: float, *,
                     wait: bool = False) -> None:
    """Return once a worker advertises resource `name`; ClusterError after `timeout` s otherwise.

    A cluster that `connect` embedded will not gain workers, so it is checked once without
    waiting, unless `wait` (before a replay: its nannies restart a lost worker). The error lists
    what the workers do advertise.
    """
    embedded = client.cluster is not None and client.cluster in _EMBEDDED
    deadline = time.monotonic() + (0 if embedded and not wait else timeout)
    while True:
        resources = worker_resources(client)
        if any(res.get(name, 0) > 0 for res in resources.values()):
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    if embedded:
        raise ClusterError(f"the local cluster has no worker with resource {name!r} (its workers "
                           f"advertise: {_resource_summary(resources)}); use --device cpu, or "
                           f"--scheduler ADDR of a cluster whose workers advertise {name}")
    raise ClusterError(
        f"no worker advertises resource {name!r} (waited {timeout:g} s); workers advertise: "
        f"{_resource_summary(resources)}; start one with `dask worker ADDR --resources {name}=1`")


def gpu_report() -> tuple[str | None, str]:
    """On a worker: (None, one line on its CUDA stack) or (why Chainer cannot use CUDA there, "")."""
    from pipeline.backends import get_backend
    return get_backend().gpu_report()


def check_gpu_workers(client: distributed.Client, name: str) -> list[str]:
    """Ask every worker advertising resource `name` whether Chainer can train on CUDA there.

    Returns one summary line per worker; ClusterError naming the worker and the reason otherwise
    (rather than train- tasks failing later, or silently running on the CPU).
    """
    workers = [w for w, res in worker_resources(client).items() if res.get(name, 0) > 0]
    reports = client.run(gpu_report, workers=workers) if workers else {}
    lines = []
    for worker, (reason, summary) in sorted(reports.items()):
        if reason:
            raise ClusterError(f"worker {worker} advertises {name} but cannot train on CUDA: {reason}")
        lines.append(f"{worker}: {summary}")
    return lines


def require_workers(client: distributed.Client, n: int, timeout: float) -> None:
    """Return once at least `n` workers are connected; ClusterError after `timeout` s otherwise."""
    deadline = time.monotonic() + timeout
    while len(worker_resources(client)) < n:
        if time.monotonic() >= deadline:
            raise ClusterError(f"scheduler {client.scheduler.address} has "
                               f"{len(worker_resources(client))} workers, needs {n} "
                               f"(waited {timeout:g} s); start some with `dask worker "
                               f"{client.scheduler.address}`")
        time.sleep(_POLL_S)


def _resource_summary(resources: dict[str, dict[str, float]]) -> str:
    """One line per cluster: `addr CPU=1, addr2 (none)`.

    >>> _resource_summary({"tcp://a:1": {"CPU": 1.0, "GPU": 2.0}, "tcp://b:2": {}})
    'tcp://a:1 CPU=1 GPU=2, tcp://b:2 (none)'
    >>> _resource_summary({})
    '(no workers connected)'
    """
    if not resources:
        return "(no workers connected)"
    parts = []
    for addr, res in sorted(resources.items()):
        text = " ".join(f"{k}={v:g}" for k, v in sorted(res.items())) or "(none)"
        parts.append(f"{addr} {text}")
    return ", ".join(parts)


def describe(client: distributed.Client) -> dict:
    """Scheduler, worker count, total threads, total resources and dashboard link, for logs.

    Returns {"scheduler": str, "workers": int, "threads": int, "resources": {name: total}
    (less the `RANK-i` resources), "ranks": int,
    "per_worker": {addr: {"nthreads": int, "resources": {...}}}, "dashboard": str | None}.
    """
    workers = client.scheduler_info(n_workers=-1)["workers"]
    resources = {addr: dict(info.get("resources") or {}) for addr, info in workers.items()}
    totals: dict[str, float] = {}
    for res in resources.values():
        for name, amount in res.items():
            if not name.startswith(RANK):  # one per training worker: `ranks` counts them
                totals[name] = totals.get(name, 0) + amount
    return {
        "scheduler": client.scheduler.address,
        "workers": len(workers),
        "threads": sum(info["nthreads"] for info in workers.values()),
        "resources": dict(sorted(totals.items())),
        "ranks": len(worker_ranks(resources)),
        "per_worker": {addr: {"nthreads": info["nthreads"], "resources": resources[addr]}
                       for addr, info in sorted(workers.items())},
        "dashboard": _dashboard_link(client),
    }


def _dashboard_link(client: distributed.Client) -> str | None:
    try:
        return client.dashboard_link
    except (KeyError, AttributeError):  # the scheduler runs without a dashboard (no bokeh)
        return None


def _summary_line(what: str, client: distributed.Client) -> str:
    d = describe(client)
    res = " ".join(f"{k}={v:g}" for k, v in d["resources"].items()) or "none"
    return (f"{what} {d['scheduler']}: {d['workers']} workers, {d['threads']} threads, "
            f"resources {res}; dashboard {d['dashboard'] or '(off)'}")
