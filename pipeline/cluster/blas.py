"""Which BLAS kernel each worker runs: one warning line where they differ, and pinning one kernel.

OpenBLAS picks its kernels by CPU when it loads (``OPENBLAS_CORETYPE`` overrides the choice), and
different kernels add in different orders: the same run gives other bits under SkylakeX than
under Haswell (docs/reliability.md, "The scope of byte-identical"). Results are the same bits on
any number of workers of one kind; on a cluster that mixes kinds they depend on which worker ran
which replica. :func:`check` says so at the start of a run, and with ``cluster.blas_kernel`` every
worker runs one kernel: the embedded cluster's workers are started with it, an external
cluster's nannies restart their workers with it.

oneDNN, which runs the convolutions on CPU workers, also picks its kernels by CPU (AVX2 or
AVX-512): a pinned BLAS kernel pins oneDNN's instruction set with it (``ONEDNN_MAX_CPU_ISA``, the
set of that kernel's CPUs: :func:`onednn_isa`), so one ``--blas-kernel`` gives one answer for both.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import NamedTuple

from pipeline.core.errors import ClusterError

ENV = "OPENBLAS_CORETYPE"
ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"
# OpenBLAS kernel (lower case) -> the instruction set of its CPUs, as oneDNN names it
_ISA = {**dict.fromkeys(("prescott", "core2", "penryn", "dunnington", "nehalem", "atom"), "SSE41"),
        **dict.fromkeys(("sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"),
                        "AVX"),
        **dict.fromkeys(("haswell", "zen"), "AVX2"),
        **dict.fromkeys(("skylakex", "cooperlake", "sapphirerapids"), "AVX512_CORE")}


class Blas(NamedTuple):
    """What one process multiplies matrices with."""
    kernel: str  # OpenBLAS's architecture ("SkylakeX", "Haswell"), or the library's name
    library: str  # "openblas 0.3.31.188.0"
    numpy: str  # NumPy's version


def local() -> Blas:
    """This process's BLAS (runs on each worker)."""
    import numpy
    from threadpoolctl import threadpool_info
    found = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    if not found:
        return Blas("none", "none", numpy.__version__)
    info = found[0]
    return Blas(str(info.get("architecture") or info.get("internal_api")),
                f"{info.get('internal_api')} {info.get('version')}", numpy.__version__)


def mismatch(blas: dict[str, Blas]) -> str | None:
    """One line when the workers' kernels or libraries differ, else None.

    >>> a, b = Blas("SkylakeX", "openblas 0.3.31", "2.3.5"), Blas("Haswell", "openblas 0.3.31", "2.3.5")
    >>> mismatch({"tcp://a:1": a, "tcp://b:2": a}) is None
    True
    >>> print(mismatch({"tcp://a:1": a, "tcp://b:2": b, "tcp://c:3": b}))
    ... # doctest: +NORMALIZE_WHITESPACE
    warning: the workers run different BLAS (SkylakeX, openblas 0.3.31, numpy 2.3.5 on tcp://a:1;
    Haswell, openblas 0.3.31, numpy 2.3.5 on tcp://b:2, tcp://c:3): results then depend on which
    worker ran which replica; --blas-kernel KERNEL runs one kernel everywhere
    (docs/reliability.md)
    """
    kinds = _kinds(blas)
    return None if kinds is None else (f"warning: the workers run different BLAS ({kinds}): results then depend on which "
            "worker ran which replica; --blas-kernel KERNEL runs one kernel everywhere "
            "(docs/reliability.md)")


def _kinds(blas: dict[str, Blas]) -> str | None:
    """"K, lib, numpy V on w1, w2; ..." for two or more kinds, None for one."""
    groups: dict[Blas, list[str]] = {}
    for worker, info in sorted(blas.items()):
        groups.setdefault(info, []).append(worker)
    if len(groups) < 2:
        return None
    return "; ".join(f"{b.kernel}, {b.library}, numpy {b.numpy} on {', '.join(w)}"
                     for b, w in groups.items())


def onednn_isa(kernel: str | None) -> str | None:
    """oneDNN's ``ONEDNN_MAX_CPU_ISA`` for the CPUs of an OpenBLAS kernel (None: leave it).

    >>> onednn_isa("Haswell"), onednn_isa("SkylakeX"), onednn_isa(None), onednn_isa("ARMV8")
    ('AVX2', 'AVX512_CORE', None, None)
    """
    return _ISA.get(kernel.lower()) if kernel else None


def pinned_environ(kernel: str | None) -> dict:
    """The environment a worker pinned to ``kernel`` starts with (that of a machine of its kind).

    >>> pinned_environ("Zen")
    {'OPENBLAS_CORETYPE': 'Zen', 'ONEDNN_MAX_CPU_ISA': 'AVX2'}
    """
    if not kernel:
        return {}
    isa = onednn_isa(kernel)
    return {ENV: kernel, **({ONEDNN_ENV: isa} if isa else {})}


@contextlib.contextmanager
def environ_kept():
    """Put ``OPENBLAS_CORETYPE`` and ``ONEDNN_MAX_CPU_ISA`` of this process back as they were.

    A nanny sets its ``pre-spawn-environ`` in its own process before it spawns a worker (the
    variable must be there before the worker imports NumPy): the embedded cluster's nannies live
    in the driver, so a pinned kernel would stay in the driver's environment and reach every
    process it starts later (another cluster, a test's subprocess)."""
    before = {name: os.environ.get(name) for name in (ENV, ONEDNN_ENV)}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def spawn_environ(kernel: str | None) -> dict:
    """Dask config that makes nannies start their workers with ``kernel`` (empty without one).

    >>> spawn_environ("Haswell")  # doctest: +NORMALIZE_WHITESPACE
    {'distributed.nanny.pre-spawn-environ.OPENBLAS_CORETYPE': 'Haswell',
     'distributed.nanny.pre-spawn-environ.ONEDNN_MAX_CPU_ISA': 'AVX2'}
    """
    return {f"distributed.nanny.pre-spawn-environ.{name}": value
            for name, value in pinned_environ(kernel).items()}


# ---------------------------------------------------------------------------------------------
# The Dask side (the client is passed in: this module imports no dask)


def survey(client) -> dict[str, Blas]:
    """{worker address: its BLAS}."""
    return {addr: Blas(*info) for addr, info in client.run(local).items()}


def _set_kernel(kernel: str, dask_worker=None) -> None:
    """Runs on a nanny: its next worker process starts with ``OPENBLAS_CORETYPE=kernel`` (and
    oneDNN's instruction set of that kernel's CPUs)."""
    for name, value in pinned_environ(kernel).items():
        dask_worker.pre_spawn_env[name] = value
        dask_worker.env[name] = value


def pin(client, kernel: str, timeout: float) -> None:
    """Restart an external cluster's workers with ``kernel``; ClusterError where one cannot be
    (a worker without a nanny) or the workers still differ afterwards."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    bare = sorted(a for a, w in workers.items() if not w.get("nanny"))
    if bare:
        raise ClusterError(f"--blas-kernel {kernel}: worker(s) {', '.join(bare)} run without a "
                           f"nanny, so they cannot be restarted with {ENV}={kernel}; start them "
                           f"with {ENV}={kernel} in their environment")
    client.run(_set_kernel, kernel, nanny=True)
    client.restart(timeout=timeout, wait_for_workers=True)


def check(client, kernel: str | None, log: Callable[[str], None], *, restart: bool,
          timeout: float = 60.0, precision: str = "fp32") -> dict[str, Blas]:
    """At the start of a run: pin ``kernel`` (``restart``: by restarting the workers), then log
    one warning line when the workers' BLAS differ, and for a bf16 run one when their bf16
    instructions do (``core.precision.workers_mismatch``). Returns the survey."""
    blas = survey(client)
    if kernel and restart and any(b.kernel.lower() != kernel.lower() for b in blas.values()):
        pin(client, kernel, timeout)
        blas = survey(client)
    if kernel and _kinds(blas):
        raise ClusterError(f"--blas-kernel {kernel} did not give one kernel: {_kinds(blas)}")
    line = mismatch(blas)
    if line:
        log(line)
    if precision == "bf16":
        from pipeline.core.precision import cpu_flags, workers_mismatch
        line = workers_mismatch(client.run(cpu_flags))
        if line:
            log(line)
    return blas
