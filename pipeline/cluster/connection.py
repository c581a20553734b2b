"""Connecting to Dask: an embedded cluster (``pipeline.cluster.embedded``) or an external
scheduler (its protocol checked, TLS), then the fail-fast checks of what its workers offer
(``pipeline.cluster.resources``).

The package's front: ``connect`` and ``security_from`` are defined here; the names of
``embedded`` and ``resources`` that callers use with them are importable from here too.
"""
from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterator, Sequence

import distributed
from distributed.security import Security

from pipeline.cluster import embedded, resources
from pipeline.cluster.embedded import (PROCESSES_PER_CORE, WORKER_BYTES,  # noqa: F401 (front)
                                       Roles, available_memory, capacity, check_capacity,
                                       check_dashboard_host, default_workers, local_gpus)
from pipeline.cluster.resources import (RANK, check_gpu_workers, describe,  # noqa: F401 (front)
                                        gpu_report, has_resource, rank_resource,
                                        require_resource, require_workers, worker_ranks,
                                        worker_resources)
from pipeline.core.config_cluster import ClusterConfig
from pipeline.core.errors import ClusterError, one_line
from pipeline.core.threads import limit_blas_threads, worker_threads  # noqa: F401 (one home: threads)

logger = logging.getLogger(__name__)

_TLS_FIELDS = (("tls_ca_file", "--tls-ca-file"), ("tls_cert", "--tls-cert"), ("tls_key", "--tls-key"))


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
            embedded.check_dashboard_host(cfg.dashboard_address)
        with embedded.embedded_cluster(cfg, list(gpus), roles) as client:
            log(resources.summary_line("started local cluster", client))
            yield client
        return
    with _external_client(address, security, cfg.connect_timeout) as client:
        resources.require_workers(client, min_workers, cfg.connect_timeout)
        log(resources.summary_line("connected to", client))
        yield client


def has_ucx() -> bool:
    """Whether a UCX transport for distributed is installed (ucx-py or distributed-ucxx)."""
    import importlib.util
    return any(importlib.util.find_spec(m) is not None for m in ("ucp", "distributed_ucxx"))


def check_protocol(address: str) -> None:
    """ClusterError when ``address`` names a transport this installation cannot speak: an
    unknown one, or ``ucx://`` without UCX (distributed's own error there is a ``TypeError``
    about an abstract class).

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
