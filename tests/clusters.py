"""Test helpers for behaviour that needs real processes: subprocess Dask clusters, TLS files, a headless dashboard.

Everything binds to 127.0.0.1, waits with a bound and cleans up after itself:
- `subprocess_cluster(...)`: a real `dask scheduler` and N `dask worker` processes (the
  docs/cluster.md recipe), optionally over TLS; yields a `SubprocessCluster`.
- `make_tls(directory)`: a CA and scheduler/worker/client certificates (cryptography).
- `dashboard_stage_names(url)`: headless Chromium opens a dashboard page and reads the stage
  names (key prefixes) from the task stream's Bokeh data source; optionally screenshots it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]


def train_cli(*args: str) -> subprocess.Popen:
    """``python -m pipeline train ARGS`` from the repository, on the CPU, in a session of its own
    (a test signals its process group as a terminal signals the foreground job: the driver and
    an embedded cluster's worker processes alike); stdout and stderr piped as text."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-m", "pipeline", "train", *args], cwd=str(REPO),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
# Debian's Chromium in a container: no sandbox (no user namespaces), no GPU, and nothing that
# phones home (the machine has no internet; those requests only slow the start down).
CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync")
START_TIMEOUT_S = 30.0  # scheduler file written + all workers connected; ~2 s measured on 2 cores
STOP_TIMEOUT_S = 10.0  # SIGTERM grace before SIGKILL


# ---------------------------------------------------------------------------------------------
# TLS


class TLSFiles(NamedTuple):
    """PEM paths for one party: the CA it trusts, its certificate and its private key."""
    ca_file: str
    cert: str
    key: str


def make_tls(directory: str | os.PathLike, roles: Sequence[str] = ("scheduler", "worker", "client"),
             ca_name: str = "dask-test-ca") -> dict[str, TLSFiles]:
    """A fresh CA in `directory` and one certificate per role signed by it: {role: TLSFiles}.

    Certificates name 127.0.0.1 and localhost and allow server and client auth (distributed
    authenticates both ends). Call twice with different `ca_name`s for a CA the cluster does not
    trust. EC P-256 keys: generating all of them takes ~10 ms.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write(path: Path, key, cert) -> None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def builder(subject: str, issuer: str, key) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=2)))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (builder(ca_name, ca_name, ca_key)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    ca_path = directory / ca_name
    write(ca_path, ca_key, ca_cert)

    files = {}
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (builder(f"{role}.{ca_name}", ca_name, key)
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                    critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(ca_key, hashes.SHA256()))
        path = directory / f"{ca_name}-{role}"
        write(path, key, cert)
        files[role] = TLSFiles(str(ca_path.with_suffix(".pem")), str(path.with_suffix(".pem")),
                               str(path.with_suffix(".key")))
    return files


def client_security(files: TLSFiles | None):
    """A distributed `Security` for a client holding `files` (None -> None)."""
    if files is None:
        return None
    from distributed.security import Security
    return Security(tls_ca_file=files.ca_file, tls_client_cert=files.cert,
                    tls_client_key=files.key, require_encryption=True)


# ---------------------------------------------------------------------------------------------
# Subprocess clusters


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class SubprocessCluster:
    """A running `dask scheduler` + `dask worker` processes; `address` is what clients dial."""
    address: str
    dashboard: str | None  # http://127.0.0.1:PORT/status, or None without a dashboard
    security: object | None  # the client Security for a TLS cluster
    tls: Mapping[str, TLSFiles] | None
    scheduler: subprocess.Popen
    workers: list[subprocess.Popen]
    logdir: Path

    def logs(self, tail: int = 4000) -> str:
        """The last `tail` characters of every process's output, for assertion messages."""
        parts = []
        for path in sorted(self.logdir.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def kill_worker(self, index: int) -> None:
        """SIGKILL worker `index` and its children at once (a crash, not a shutdown)."""
        _killpg(self.workers[index], signal.SIGKILL)


def _dask_cmd(*args: str) -> list[str]:
    # `python -m dask` is the `dask` console script of this interpreter, independent of PATH.
    return [sys.executable, "-m", "dask", *args]


def _tls_args(files: TLSFiles | None) -> list[str]:
    if files is None:
        return []
    return ["--tls-ca-file", files.ca_file, "--tls-cert", files.cert, "--tls-key", files.key]


def _resource_arg(resources: Mapping[str, float] | None) -> list[str]:
    """`--resources "CPU=1 GPU=1"`, or nothing.

    >>> _resource_arg({"CPU": 1, "GPU": 2})
    ['--resources', 'CPU=1 GPU=2']
    """
    if not resources:
        return []
    return ["--resources", " ".join(f"{k}={v:g}" for k, v in resources.items())]


def _popen(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "wb") as out:  # the child keeps its own descriptor
        # A new session per process: teardown signals its whole group (nanny + worker).
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, cwd=str(log.parent))


def _killpg(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # pgid == pid thanks to start_new_session


def _stop(procs: Sequence[subprocess.Popen], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM each process (a graceful close), then SIGKILL its group after `timeout` s."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        _killpg(proc, signal.SIGKILL)  # stragglers: a worker whose nanny already exited
        proc.wait()


def _child_env(extra: Mapping[str, str] | None = None) -> dict:
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    env["PYTHONUNBUFFERED"] = "1"  # logs complete at any moment, for failure messages
    return env


def _wait_for_scheduler_file(path: Path, proc: subprocess.Popen, deadline: float,
                             logdir: Path) -> dict:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dask scheduler exited with {proc.returncode}:\n"
                               f"{(logdir / 'scheduler.log').read_text(errors='replace')[-4000:]}")
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            info = json.loads(path.read_text())
            if info.get("address"):
                return info
        time.sleep(0.05)
    raise TimeoutError(f"dask scheduler wrote no {path.name} in time")


@contextlib.contextmanager
def subprocess_cluster(n_workers: int = 2,
                       resources: Mapping[str, float] | Sequence[Mapping[str, float] | None] | None = None,
                       nthreads: int = 1, tls: Mapping[str, TLSFiles] | None = None,
                       dashboard: bool = True, timeout: float = START_TIMEOUT_S,
                       env: Mapping[str, str] | None = None,
                       worker_env: Sequence[Mapping[str, str]] | None = None,
                       nanny: bool = True) -> Iterator[SubprocessCluster]:
    """Start `dask scheduler` and `n_workers` x `dask worker --nworkers 1` on 127.0.0.1.

    resources: one mapping for every worker, or a list with one (or None) per worker, e.g.
    `[{"CPU": 1}, {"GPU": 1}]`. tls: `make_tls(...)` output; the scheduler and workers use its
    "scheduler"/"worker" files and `security` is built from "client". Returns once every worker
    is connected (at most `timeout` s, else TimeoutError with the logs); on exit stops workers,
    then the scheduler (SIGTERM, SIGKILL after 10 s), even when the body raised. env: variables
    set for the processes on top of this one's, e.g. Dask config
    (`DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED="False"`); worker_env: one mapping per worker
    on top of that (`[{"OPENBLAS_CORETYPE": "Haswell"}, ...]`). nanny=False: `--no-nanny`.
    """
    import distributed

    if resources is None or isinstance(resources, Mapping):
        per_worker = [resources] * n_workers
    else:
        per_worker = list(resources)
        if len(per_worker) != n_workers:
            raise ValueError(f"resources has {len(per_worker)} entries for {n_workers} workers")
    tmp = tempfile.TemporaryDirectory(prefix="dask-subprocess-cluster-")
    logdir = Path(tmp.name)
    env = _child_env(env)
    deadline = time.monotonic() + timeout
    scheduler = None
    workers: list[subprocess.Popen] = []
    try:
        sched_file = logdir / "scheduler.json"
        scheduler = _popen(_dask_cmd(
            "scheduler", "--host", "127.0.0.1", "--port", "0", "--scheduler-file", str(sched_file),
            *(["--protocol", "tls"] if tls else []), *_tls_args(tls and tls["scheduler"]),
            *(["--dashboard-address", "127.0.0.1:0"] if dashboard else ["--no-dashboard"])),
            logdir / "scheduler.log", env)
        info = _wait_for_scheduler_file(sched_file, scheduler, deadline, logdir)
        address = info["address"]
        for i, res in enumerate(per_worker):
            workers.append(_popen(_dask_cmd(
                "worker", address, "--nworkers", "1", "--nthreads", str(nthreads),
                "--host", "127.0.0.1", "--name", f"worker-{i}", "--no-dashboard",
                "--death-timeout", str(int(timeout)), "--local-directory", str(logdir / f"w{i}"),
                *_resource_arg(res), *_tls_args(tls and tls["worker"]),
                *([] if nanny else ["--no-nanny"])),
                logdir / f"worker-{i}.log", {**env, **(worker_env[i] if worker_env else {})}))
        security = client_security(tls and tls["client"])
        port = (info.get("services") or {}).get("dashboard")
        cluster = SubprocessCluster(address, port and f"http://127.0.0.1:{port}/status", security,
                                    tls, scheduler, workers, logdir)
        with distributed.Client(address, security=security,
                                timeout=max(1.0, deadline - time.monotonic())) as client:
            try:
                if n_workers:
                    client.wait_for_workers(n_workers, timeout=max(1.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"{n_workers} dask workers did not connect within {timeout:g} s:"
                                   f"\n{cluster.logs()}") from None
        yield cluster
    finally:
        # Workers first: a nanny whose scheduler is already gone retries for ~8 s before exiting.
        _stop(workers)
        _stop([scheduler] if scheduler else [])
        tmp.cleanup()


# ---------------------------------------------------------------------------------------------
# Headless dashboard


class Killer:
    """Kills workers mid-round: when round ``after`` is reported, a thread waits until worker
    ``index`` is busy with a ``stage`` task of a later round and SIGKILLs it (and its nanny)."""

    def __init__(self, cluster, plan: dict[int, int], stage: str = "train",
                 holding: bool = False):
        """``holding``: a worker that holds any result counts as busy too (async's train tasks
        are a few ms each and need not land on it: a run can end before one is seen there)."""
        import distributed
        self.cluster, self.plan, self.stage, self.holding = cluster, dict(plan), stage, holding
        self.client = distributed.Client(cluster.address, set_as_default=False)
        names = {info["name"]: addr for addr, info in
                 self.client.scheduler_info(n_workers=-1)["workers"].items()}
        self.address = {i: names[f"worker-{i}"] for i in plan.values()}
        self.killed: list[tuple[int, int, str]] = []  # (worker, after round, busy key)
        self.threads: list[threading.Thread] = []

    def __call__(self, line: dict) -> None:
        index = self.plan.pop(line["round"], None)
        if index is not None:
            thread = threading.Thread(target=self._kill_when_busy, args=(index, line["round"]),
                                      daemon=True)
            thread.start()
            self.threads.append(thread)

    def _kill_when_busy(self, index: int, after: int, timeout: float = 20.0) -> None:
        addr, deadline = self.address[index], time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = [k for k in self.client.processing(workers=[addr]).get(addr, ())
                    if str(k).startswith(f"('{self.stage}-")]
            if self.holding and not busy:  # anything it holds is lost with it
                busy = list(self.client.has_what(workers=[addr]).get(addr, ()))
            if busy:
                self.cluster.kill_worker(index)
                self.killed.append((index, after, str(busy[0])))
                return
            time.sleep(0.002)

    def close(self) -> None:
        for thread in self.threads:
            thread.join(30)
        self.client.close()


def browser_skip_reason() -> str | None:
    """Why a browser test cannot run here, or None. Under CI=true nothing is skipped: a missing
    Chromium or Playwright must fail the test (.ci/run installs both)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return None
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is absent (apt-get install chromium) and CI is not set"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]') and CI is not set"
    return None


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 1000) -> Iterator[object]:
    """A Playwright page in Debian's headless Chromium; the browser closes on exit."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=list(CHROMIUM_ARGS),
                                    headless=True)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()


# The dashboard's Bokeh data sources, read in the page (BokehJS 3 keeps `data` as a plain object):
# - task stream (distributed.dashboard.components.scheduler.TaskStream): columns start, duration,
#   key, name, worker_thread...; `name` is key_split(key), the stage prefix without the run token,
#   and "transfer-<stage>" for the data transfers feeding it;
# - progress bars (TaskProgress, on /status): columns name, show-name, all, memory, done...
_SOURCE_NAMES_JS = """(kind) => {
  const names = new Set();
  for (const doc of (window.Bokeh && Bokeh.documents) || []) {
    for (const model of doc.all_models) {
      const data = model.data;
      if (!data || data instanceof Map || !("name" in data)) continue;
      const isKind = kind === "task-stream" ? "worker_thread" in data : "show-name" in data;
      if (isKind) for (const name of data.name) names.add(String(name));
    }
  }
  return [...names];
}"""
_BOKEH_READY_JS = "() => window.Bokeh && Bokeh.documents && Bokeh.documents.length > 0"
# The options of a selector whose title starts with `prefix`: on /individual-fine-performance-metrics
# "Filter by span tag (N):" lists the span tags (distributed.span names) the scheduler has seen.
_SELECTOR_OPTIONS_JS = """(prefix) => {
  const options = new Set();
  for (const doc of (window.Bokeh && Bokeh.documents) || []) {
    for (const model of doc.all_models) {
      if (typeof model.title !== "string" || !model.title.startsWith(prefix)) continue;
      for (const opt of model.options || []) options.add(String(Array.isArray(opt) ? opt[0] : opt));
    }
  }
  return [...options];
}"""


def record_task_stream(client) -> None:
    """Make the scheduler record its task stream from now on.

    The scheduler only starts recording when a task-stream page is first opened (or someone asks
    for the stream); tasks that finished before are never shown. Call this before submitting
    work that a later `dashboard_stage_names` should see, or open the dashboard first.
    """
    client.get_task_stream(count=1)


class Dashboard:
    """An open dashboard page in headless Chromium (see `open_dashboard`)."""

    def __init__(self, page, url: str):
        self.page, self.url = page, url

    def task_stream_names(self) -> set[str]:
        """Stage names now in the task stream, without the "transfer-<stage>" entries."""
        names = self.page.evaluate(_SOURCE_NAMES_JS, "task-stream")
        return {n for n in names if not n.startswith("transfer-")}

    def progress_names(self) -> set[str]:
        """Stage names on the progress bars (/status only; a finished, released job has none)."""
        return set(self.page.evaluate(_SOURCE_NAMES_JS, "progress"))

    def span_tags(self) -> set[str]:
        """Span tags listed on /individual-fine-performance-metrics (its "Filter by span tag")."""
        return set(self.page.evaluate(_SELECTOR_OPTIONS_JS, "Filter by span tag"))

    def goto(self, path: str, timeout: float = 30.0) -> None:
        """Open another dashboard page, e.g. "/individual-fine-performance-metrics"."""
        base = self.url.split("://", 1)[0] + "://" + self.url.split("://", 1)[1].split("/", 1)[0]
        self.url = base + path
        self.page.goto(self.url, timeout=timeout * 1000)
        self.page.wait_for_function(_BOKEH_READY_JS, timeout=timeout * 1000)

    def wait_for(self, read, expected=frozenset(), timeout: float = 30.0) -> set[str]:
        """Poll `read()` (a method above) until it holds all of `expected` (anything when empty)
        or `timeout` s pass; return what it holds then (the caller asserts)."""
        deadline = time.monotonic() + timeout
        while True:
            names = read()
            if (names and set(expected) <= names) or time.monotonic() >= deadline:
                return names
            self.page.wait_for_timeout(200)  # the page patches its sources every ~100 ms

    def wait_for_stages(self, expected=frozenset(), timeout: float = 30.0) -> set[str]:
        """`wait_for(self.task_stream_names, ...)`: the stages in the task stream."""
        return self.wait_for(self.task_stream_names, expected, timeout)

    def screenshot(self, path: str | os.PathLike) -> Path:
        """Save a full-page PNG at `path` (parent directories created) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.wait_for_timeout(300)  # let the last patch paint
        self.page.screenshot(path=str(path), full_page=True)
        return path


@contextlib.contextmanager
def open_dashboard(url: str, timeout: float = 30.0) -> Iterator[Dashboard]:
    """Open dashboard page `url` (/status, /individual-task-stream...) headless; wait for Bokeh.

    Opening a task-stream page also starts the scheduler's task-stream recording, so open it
    before submitting the job to watch (or call `record_task_stream(client)`).
    """
    with chromium_page() as page:
        page.goto(url, timeout=timeout * 1000)
        page.wait_for_function(_BOKEH_READY_JS, timeout=timeout * 1000)
        yield Dashboard(page, url)


def dashboard_stage_names(url: str, expected=frozenset(), timeout: float = 30.0,
                          screenshot: str | os.PathLike | None = None) -> set[str]:
    """One shot: open `url` headless, wait for `expected` stages in the task stream, return the
    names there; optionally save a screenshot. The job must already be recorded (see
    `record_task_stream`)."""
    with open_dashboard(url, timeout) as dash:
        names = dash.wait_for_stages(expected, timeout)
        if screenshot is not None:
            dash.screenshot(screenshot)
    return names
