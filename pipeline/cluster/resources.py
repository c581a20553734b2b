"""What the connected workers offer: resources and ranks, waiting for a worker or a resource, the
GPU check, and the cluster described in one value and one log line. Every function takes a
``distributed.Client``; this module starts nothing."""
from __future__ import annotations

import time
import weakref

import distributed

from pipeline.core.errors import ClusterError

_POLL_S = 0.1  # how often require_* ask the scheduler again; a scheduler_info round trip is ~1 ms
# The clusters ``pipeline.cluster.embedded`` started: they never gain workers, so a missing
# resource is reported at once (``require_resource``).
EMBEDDED: weakref.WeakSet = weakref.WeakSet()


RANK = "RANK-"  # prefix of the resource that names a training worker's rank: RANK-0, RANK-1, ...


# A worker in these states takes no new task: Dask is retiring it (``retire_workers``, an
# adaptive scale-down: it hands its keys over, then closes) or it is closing.
LEAVING = ("closing_gracefully", "closing", "closed", "failed")


def staying(workers: dict) -> dict:
    """The entries of ``scheduler_info()["workers"]`` that are not leaving (:data:`LEAVING`):
    the workers a placement may give replicas to.

    >>> sorted(staying({"a": {"status": "running"}, "b": {"status": "closing_gracefully"},
    ...                 "c": {}}))
    ['a', 'c']
    """
    return {a: w for a, w in workers.items() if w.get("status") not in LEAVING}


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

    A cluster that `connect` embedded (``EMBEDDED``) will not gain workers, so it is checked once without
    waiting, unless `wait` (before a replay: its nannies restart a lost worker). The error lists
    what the workers do advertise.
    """
    embedded = client.cluster is not None and client.cluster in EMBEDDED
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


def _count(n: int, word: str) -> str:
    """``n word``, plural unless n is 1.

    >>> _count(1, "worker"), _count(2, "thread")
    ('1 worker', '2 threads')
    """
    return f"{n} {word}" + ("" if n == 1 else "s")


def summary_line(what: str, client: distributed.Client) -> str:
    d = describe(client)
    res = " ".join(f"{k}={v:g}" for k, v in d["resources"].items()) or "none"
    return (f"{what} {d['scheduler']}: {_count(d['workers'], 'worker')}, "
            f"{_count(d['threads'], 'thread')}, "
            f"resources {res}; dashboard {d['dashboard'] or '(off)'}")
