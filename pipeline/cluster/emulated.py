"""Emulated hosts on one machine: network namespaces on a rate-capped switch, with Dask in them.

``emulated_cluster(hosts=3, rate="100mbit")`` builds, for one run named ``dcpe<6 hex>``:

- a *switch* namespace holding a Linux bridge, and one veth pair per host into it;
- a *head* namespace (10.213.X.1) running ``dask scheduler``, where the driver runs too;
- ``hosts`` host namespaces (10.213.X.11, .12, ...) each running ``workers_per_host``
  ``dask worker`` processes named ``host<i>-<j>``, all bound to that host's one address, so
  their addresses say which host they are on, as on a real cluster;
- ``tc qdisc ... tbf`` at ``rate`` on both ends of every veth pair: a host sends and receives at
  most ``rate`` each way (full duplex, like a switched Ethernet port). Netem is not available
  in every kernel; tbf is.
- jumbo frames (MTU 9000), as cluster networks use: the kernel's work is per packet, and with
  8 hosts exchanging 100 Mb/s each at MTU 1500 it took 1.5 of this machine's 2 cores (raw
  sockets, 84 MB each way per host: 11.5 CPU s in 7.7 s) against 0.33 at MTU 9000, which would
  make the cores, not the links, the bottleneck. ``mtu=1500`` is there for comparison.

Bytes between two hosts cross two capped links; bytes between workers of one host stay on that
namespace's loopback, uncapped, like shared memory on a real host. Every address lives inside
the run's own namespaces (the root namespace gets no address, route or link), so no traffic can
leave them. Teardown (on exit, on an exception, on SIGTERM, at interpreter exit) stops the
processes and deletes the namespaces, which deletes their links; a run whose owner was killed
with SIGKILL is removed by the next run (``cleanup_stale``) or by ``python -m pipeline.cluster.emulated
cleanup``. It needs root, ``ip`` and ``tc`` (iproute2); ``skip_reason()`` says what is missing.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from pipeline.core.errors import one_line

FAMILY = "dcpe"  # every namespace of ours starts with this, then 6 hex digits of the run
_NAME = re.compile(rf"^({FAMILY}[0-9a-f]{{6}})-(sw|head|host\d+)$")
STATE_DIR = Path(os.environ.get("DCP_EMULATED_STATE", "/run/dcp-emulated"))
SCHEDULER_PORT = 8786
START_TIMEOUT_S = 90.0  # 8 hosts' workers import dask on 2 loaded cores: ~20 s measured
STOP_TIMEOUT_S = 10.0
_REPO = Path(__file__).resolve().parents[2]


def parse_rate(rate: str | float) -> float:
    """Bits per second from tc's notation ("100mbit", "1gbit", "500kbit") or a number.

    >>> parse_rate("100mbit"), parse_rate("1.5gbit"), parse_rate(2e6)
    (100000000.0, 1500000000.0, 2000000.0)
    """
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        match = re.fullmatch(r"\s*([0-9.]+)\s*(k|m|g)?bit\s*", str(rate).lower())
        if not match:
            raise ValueError(f"rate must look like 100mbit, 1gbit or 500kbit, got {rate!r}")
        value = float(match.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    if not value > 0:
        raise ValueError(f"rate must be > 0 bit/s, got {rate!r}")
    return value


def _run(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): "
                           f"{' '.join(done.stderr.split())}")
    return done


def skip_reason() -> str | None:
    """Why emulated hosts cannot run here (one line), or None when they can.

    Checks root, ``ip`` and ``tc``, and that a namespace with a veth pair and a tbf qdisc can
    actually be made (a container may lack the capability or the kernel modules)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces), and this is not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated hosts need `{tool}` (apt-get install iproute2), and it is missing"
    probe = f"{FAMILY}{secrets.token_hex(3)}-sw"
    try:
        _run("ip", "netns", "add", probe)
        try:
            _run("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
            _run("tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1mbit",
                 "burst", "32kb", "latency", "50ms")
            _run("ip", "-n", probe, "link", "add", "br0", "type", "bridge")
        finally:
            _run("ip", "netns", "del", probe, check=False)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        name = getattr(exc, "filename", None)  # the command that is missing, for an OSError
        what = f"{name}: " if name else ""
        return f"cannot build an emulated host here: {what}{one_line(exc, kind=False)}"
    return None


# ---------------------------------------------------------------------------------------------
# Run records: which runs exist, who owns them, so a crashed run's leftovers can be found


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(record: Mapping) -> bool:
    return _start_time(int(record.get("pid", -1))) == record.get("start")


def list_namespaces() -> list[str]:
    """Names of our namespaces now present (any run)."""
    done = _run("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if _NAME.match(n))


def _run_processes(run: str) -> list[int]:
    """PIDs of processes started for ``run`` (their environment carries DCP_EMULATED_RUN)."""
    pids, marker = [], f"DCP_EMULATED_RUN={run}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


def leftovers(run: str) -> list[str]:
    """What of ``run`` still exists: namespaces and processes, as readable strings."""
    found = [f"netns {n}" for n in list_namespaces() if n.startswith(run + "-")]
    found += [f"process {pid}" for pid in _run_processes(run)]
    if (STATE_DIR / f"{run}.json").exists():
        found.append(f"record {STATE_DIR / f'{run}.json'}")
    return found


def remove(run: str) -> None:
    """Kill ``run``'s processes, delete its namespaces (their links go with them) and its
    record."""
    for pid in _run_processes(run):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for name in list_namespaces():
        if name.startswith(run + "-"):
            _run("ip", "netns", "del", name, check=False)
    (STATE_DIR / f"{run}.json").unlink(missing_ok=True)


def cleanup_stale() -> list[str]:
    """Remove every run of ours whose owner process is gone; returns their names."""
    runs = {m.group(1) for m in map(_NAME.match, list_namespaces()) if m}
    if STATE_DIR.is_dir():
        runs |= {p.stem for p in STATE_DIR.glob(f"{FAMILY}*.json")}
    stale = []
    for run in sorted(runs):
        try:
            record = json.loads((STATE_DIR / f"{run}.json").read_text())
        except (OSError, ValueError):
            record = {}  # no record: its owner died between making the namespace and the record
        if not record or not _owner_alive(record):
            remove(run)
            stale.append(run)
    return stale


# ---------------------------------------------------------------------------------------------
# The cluster


@dataclasses.dataclass
class EmulatedCluster:
    """A running emulated cluster (see the module docstring)."""
    run: str  # dcpe<6 hex>: prefix of every namespace of this run
    rate_bps: float  # tbf rate of every link, bits/s, each direction
    subnet: str  # "10.213.X"
    head: str  # namespace of the scheduler and the driver
    hosts: list[str]  # host namespaces, in host order
    host_addresses: list[str]  # their IP addresses
    workers: list[list[str]]  # worker names per host ("host0-0", ...)
    logdir: Path
    procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)

    @property
    def scheduler_address(self) -> str:
        return f"tcp://{self.subnet}.1:{SCHEDULER_PORT}"

    @property
    def n_workers(self) -> int:
        return sum(len(w) for w in self.workers)

    def in_namespace(self, namespace: str, argv: Sequence[str]) -> list[str]:
        """``argv`` to run inside ``namespace`` (the head, or a host)."""
        return ["ip", "netns", "exec", namespace, *argv]

    def env(self) -> dict:
        """Environment for processes of this run: the repo importable, one BLAS thread per worker
        thread, no inherited scheduler address, and the run marker that teardown looks for."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH")) if p)
        env.pop("DASK_SCHEDULER_ADDRESS", None)
        env["PYTHONUNBUFFERED"] = "1"
        env["DCP_EMULATED_RUN"] = self.run
        return env

    def run_in_head(self, argv: Sequence[str], timeout: float = 600,
                    **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` in the head namespace (where the scheduler listens) and wait for it."""
        return subprocess.run(self.in_namespace(self.head, argv), env=self.env(), text=True,
                              capture_output=True, timeout=timeout, **kwargs)

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted(self.logdir.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)


def _token_subnet(token: str) -> str:
    """10.213.X with X from the run token, so two runs' logs are told apart (each run's
    addresses live in its own namespaces, so equal subnets would not clash either)."""
    return f"10.213.{int(token, 16) % 250 + 1}"


def _netns(*argv: str, ns: str | None = None) -> None:
    _run("ip", *(["-n", ns] if ns else []), *argv)


# tbf's queue, in ms of traffic at the rate: deep, as on a switch port under incast. With 8 hosts
# all-to-all at 100 Mb/s, 20 ms queues dropped 3x the packets and cost ~8% of the rate, 5 ms ~40%.
QUEUE_MS = 100


def _tbf(ns: str, dev: str, rate_bps: float) -> None:
    # burst: at least 64 KiB (a GSO segment) and 4 ms of traffic; the queue holds QUEUE_MS.
    burst = max(64 * 1024, int(rate_bps / 8 * 0.004))
    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate_bps)}bit",
         "burst", str(burst), "latency", f"{QUEUE_MS:g}ms")


def _build_network(c: EmulatedCluster, sw: str, mtu: int = 1500) -> None:
    _netns("netns", "add", sw)
    _netns("link", "add", "br0", "type", "bridge", ns=sw)
    _netns("link", "set", "br0", "mtu", str(mtu), "up", ns=sw)
    ends = [(c.head, f"{c.subnet}.1")] + list(zip(c.hosts, c.host_addresses))
    for i, (ns, address) in enumerate(ends):
        _netns("netns", "add", ns)
        port = f"p{i}"
        _netns("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns, ns=sw)
        _netns("link", "set", port, "mtu", str(mtu), "master", "br0", "up", ns=sw)
        _netns("addr", "add", f"{address}/24", "dev", "eth0", ns=ns)
        _netns("link", "set", "eth0", "mtu", str(mtu), "up", ns=ns)
        _netns("link", "set", "lo", "up", ns=ns)
        _tbf(sw, port, c.rate_bps)  # switch -> host: the host's downlink
        _tbf(ns, "eth0", c.rate_bps)  # host -> switch: its uplink


def _popen(c: EmulatedCluster, ns: str, argv: list[str], log: str, env: dict) -> None:
    with open(c.logdir / log, "wb") as out:
        c.procs.append(subprocess.Popen(c.in_namespace(ns, argv), stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True, cwd=str(c.logdir)))


def _start_dask(c: EmulatedCluster, nthreads: int, resources: Mapping[str, float] | None,
                timeout: float) -> None:
    env = c.env()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(nthreads)
    dask = [sys.executable, "-m", "dask"]
    _popen(c, c.head, [*dask, "scheduler", "--host", f"{c.subnet}.1", "--port",
                       str(SCHEDULER_PORT), "--no-dashboard"], "scheduler.log", env)
    res = ["--resources", " ".join(f"{k}={v:g}" for k, v in resources.items())] if resources \
        else []
    for ns, address, names in zip(c.hosts, c.host_addresses, c.workers):
        for name in names:
            _popen(c, ns, [*dask, "worker", c.scheduler_address, "--host", address, "--name",
                           name, "--nworkers", "1", "--nthreads", str(nthreads),
                           "--no-dashboard", "--death-timeout", str(int(timeout)),
                           "--local-directory", str(c.logdir / name), *res], f"{name}.log", env)
    wait = ("import sys, distributed\n"
            "c = distributed.Client(sys.argv[1], timeout=float(sys.argv[3]))\n"
            "if int(sys.argv[2]):\n"
            "    c.wait_for_workers(int(sys.argv[2]), timeout=float(sys.argv[3]))\n"
            "c.close()\n")
    done = c.run_in_head([sys.executable, "-c", wait, c.scheduler_address, str(c.n_workers),
                          str(timeout)], timeout=timeout + 30)
    if done.returncode != 0:
        raise TimeoutError(f"{c.n_workers} emulated workers did not connect within {timeout:g} s:"
                           f" {' '.join(done.stderr.split())[-500:]}\n{c.logs()}")


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _teardown(c: EmulatedCluster) -> None:
    _stop(c.procs)
    remove(c.run)  # anything the process groups missed, then the namespaces and the record
    deadline = time.monotonic() + 10
    while leftovers(c.run) and time.monotonic() < deadline:  # netns deletion is asynchronous
        time.sleep(0.1)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into SystemExit for the duration, so ``finally`` blocks run (main thread)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def emulated_cluster(hosts: int, rate: str | float = "100mbit",
                     workers_per_host: int | Sequence[int] = 1, nthreads: int = 1,
                     resources: Mapping[str, float] | None = None,
                     timeout: float = START_TIMEOUT_S, mtu: int = 9000
                     ) -> Iterator[EmulatedCluster]:
    """Start ``hosts`` emulated hosts on links capped at ``rate``; tear all down on exit.

    ``workers_per_host``: one count for every host or one per host, e.g. ``(2, 1, 1)``.
    ``resources``: what every worker advertises (e.g. ``{"CPU": 1}``). Returns once every
    worker is connected (at most ``timeout`` s, else TimeoutError with the logs).
    """
    if not 1 <= hosts <= 200:
        raise ValueError(f"hosts must be in 1..200, got {hosts}")
    counts = [workers_per_host] * hosts if isinstance(workers_per_host, int) \
        else list(workers_per_host)
    if len(counts) != hosts or min(counts) < 0:
        raise ValueError(f"workers_per_host must be one count >= 0 or {hosts} of them, "
                         f"got {workers_per_host!r}")
    reason = skip_reason()
    if reason:
        raise RuntimeError(reason)
    cleanup_stale()
    token = secrets.token_hex(3)
    run = f"{FAMILY}{token}"
    subnet = _token_subnet(token)
    logdir = Path(tempfile.mkdtemp(prefix=f"{run}-"))
    c = EmulatedCluster(run, parse_rate(rate), subnet, f"{run}-head",
                        [f"{run}-host{i}" for i in range(hosts)],
                        [f"{subnet}.{11 + i}" for i in range(hosts)],
                        [[f"host{i}-{j}" for j in range(n)] for i, n in enumerate(counts)],
                        logdir)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / f"{run}.json").write_text(json.dumps(
        {"pid": os.getpid(), "start": _start_time(os.getpid()), "logdir": str(logdir)}))
    hook = functools.partial(_teardown, c)
    atexit.register(hook)
    try:
        with _sigterm_raises():
            _build_network(c, f"{run}-sw", mtu)
            _start_dask(c, nthreads, resources, timeout)
            yield c
    finally:
        _teardown(c)
        atexit.unregister(hook)
        shutil.rmtree(logdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.cluster.emulated cleanup``: remove leftovers of runs whose owner is gone."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["cleanup"]:
        print("usage: python -m pipeline.cluster.emulated cleanup", file=sys.stderr)
        return 2
    removed = cleanup_stale()
    print(f"removed {len(removed)} stale emulated run(s){': ' if removed else ''}"
          f"{' '.join(removed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
