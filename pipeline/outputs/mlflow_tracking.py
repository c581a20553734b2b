"""A run's results on an MLflow tracking server (``--mlflow URI``): the config as parameters,
each round's metrics, the run's files as artifacts, through MLflow's REST API.

The client is ``requests`` and the REST API (``/api/2.0/mlflow/...``), not ``mlflow``'s own
client: importing ``mlflow.tracking`` takes ~1.5 s on the driver (``requests``: ~0.15 s), and its
calls retry with exponential back-off for minutes on a dead server unless process-wide
environment variables say otherwise. Here every call has a short timeout and no retry; after a
failure the tracker stays away for a back-off (5 s, doubling, at most 60 s) and counts the calls
it drops, so a server that is down or refuses costs the run seconds, never the run: the count
and the first reason are one warning line at the end (:meth:`Tracker.summary`).

Artifacts go through the server's artifact proxy (``mlflow server``'s default,
``mlflow-artifacts:`` run artifact URIs). The MLflow run's id is kept in ``OUT/mlflow.json``
so ``--resume OUT`` goes on logging into the same MLflow run. Pure driver code: no dask, no
chainer. Credentials come from MLflow's own variables (``MLFLOW_TRACKING_TOKEN``, or
``MLFLOW_TRACKING_USERNAME`` and ``MLFLOW_TRACKING_PASSWORD``); ``MLFLOW_EXPERIMENT_NAME``
picks the experiment (created if missing; else MLflow's Default).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable
from urllib.parse import quote, urlsplit, urlunsplit

from pipeline.core import files
from pipeline.core.errors import one_line
from pipeline.outputs import checkpoint

RECORD = "mlflow.json"  # OUT/mlflow.json: the tracking URI and the MLflow run id
# The run's files logged as artifacts when present; model.onnx is written by the ONNX export,
# which may also call :func:`attach` for a file it writes after the run.
ARTIFACTS = ("config.json", "model.npz", "curves.png", "summary.json", "model.onnx")
TIMEOUT_S = 5.0  # one call; a file upload gets this per MiB on top
BACKOFF_S, MAX_BACKOFF_S = 5.0, 60.0  # after a failed call, no call for this long (doubling)
MAX_PARAMS, MAX_METRICS = 100, 1000  # MLflow's log-batch limits per request
MAX_ARTIFACT_BYTES = 16 << 30  # one file read whole into memory to upload (model.npz: MiBs)
MAX_PARAM_CHARS = 500  # MLflow < 2.9 stores at most 500 characters of a parameter's value
NOT_PARAMS = ("mlflow",)  # the server's address (it may carry a user name) is not a parameter


def shown(uri: str) -> str:
    """The URI as messages show it: no user name or password.

    >>> shown("https://me:secret@mlflow.example:443/x")
    'https://mlflow.example:443/x'
    """
    parts = urlsplit(uri)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def params_of(config: dict, prefix: str = "") -> dict[str, str]:
    """A config dict as MLflow parameters: dotted names, JSON values (a string as it is, None as
    ``null``), cut to MAX_PARAM_CHARS; ``NOT_PARAMS`` left out.

    >>> params_of({"seed": 0, "mlflow": "http://h", "train": {"lr": 0.1, "beta1": None},
    ...            "out": "runs/a"})
    {'seed': '0', 'train.lr': '0.1', 'train.beta1': 'null', 'out': 'runs/a'}
    """
    found = {}
    for key, value in config.items():
        if not prefix and key in NOT_PARAMS:
            continue
        if isinstance(value, dict):
            found.update(params_of(value, f"{prefix}{key}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            found[prefix + key] = text[:MAX_PARAM_CHARS]
    return found


def read_record(out: Path, uri: str) -> str | None:
    """The MLflow run id ``OUT/mlflow.json`` holds for a run logged to ``uri``, or None (no
    record, an unreadable one, or one of another server)."""
    path = Path(out) / RECORD
    try:
        record = json.loads(files.read_text(path, 64 * 1024, "an MLflow record", ValueError))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("tracking_uri") != shown(uri):
        return None
    run_id = record.get("run_id")
    return run_id if isinstance(run_id, str) and run_id.isalnum() else None


class Tracker:
    """One MLflow run on the server at ``uri``, logged to without ever failing: each call that
    does not get through (down, refused, timed out, an error answer) is counted in ``lost``."""

    def __init__(self, uri: str, log: Callable[[str], None], timeout: float | None = None,
                 on_start: Callable[[str], None] | None = None):
        import requests
        self.uri, self.log, self.timeout = uri.rstrip("/"), log, timeout or TIMEOUT_S
        self.on_start = on_start  # called with the run id once the run is created or reopened
        self.session = requests.Session()
        self.session.headers.update(_auth_headers())
        self.run_id: str | None = None
        self.wanted: tuple | None = None  # (run id, name, params) of a start not yet through
        self.artifact_path: str | None = None  # where the proxy keeps this run's artifacts
        self.calls = self.lost = 0
        self.reason: str | None = None  # the first failure, for the summary
        self.quiet_until, self.backoff = 0.0, BACKOFF_S

    # ---- the run -------------------------------------------------------------------------
    def start(self, run_id: str | None, name: str | None, params: dict[str, str]) -> str | None:
        """Go on with ``run_id`` (a resume: marked RUNNING again) or, where there is none or the
        server has no such run, create a run named ``name`` and log ``params``; the run id, or
        None if the server did not answer (then the next call after the back-off tries again:
        a server that comes back gets the rest of the run)."""
        self.wanted = (run_id, name, params)
        return self._begin()

    def _begin(self) -> str | None:
        run_id, name, params = self.wanted
        if run_id is not None:
            lost = self.lost
            if self.reopen(run_id):
                self._call("POST", "runs/update", dict(run_id=run_id, status="RUNNING"))
                return self._started()
            if self.lost > lost:
                return None  # down, not a run the server forgot: no second run
        body = dict(experiment_id=self._experiment(), start_time=_now_ms(),
                    tags=[dict(key="mlflow.source.name", value="dask-chainer-pipeline")])
        created = self._call("POST", "runs/create", {**body, "run_name": name} if name else body)
        if created is None:
            return None
        self._opened(created["run"]["info"])
        items = sorted(params.items())
        for i in range(0, len(items), MAX_PARAMS):
            self._call("POST", "runs/log-batch", dict(run_id=self.run_id, params=[
                dict(key=k, value=v) for k, v in items[i:i + MAX_PARAMS]]))
        return self._started()

    def _started(self) -> str:
        self.wanted = None
        if self.on_start is not None:
            self.on_start(self.run_id)
        return self.run_id

    def _ready(self) -> None:
        """Try a start that did not get through again, once the back-off is over."""
        if self.run_id is None and self.wanted is not None \
                and time.monotonic() >= self.quiet_until:
            self._begin()

    def reopen(self, run_id: str) -> bool:
        """Whether the server has the run ``run_id`` (then it is this tracker's run); a run it
        does not know is no failure, a server that does not answer is."""
        found = self._call("GET", "runs/get", dict(run_id=run_id), missing_ok=True)
        if found:
            self._opened(found["run"]["info"])
        return bool(found)

    def last_step(self, key: str) -> int:
        """The highest step the run has logged of metric ``key`` (-1: none, or no answer)."""
        if self.run_id is None:
            return -1
        found = self._call("GET", "metrics/get-history", dict(run_id=self.run_id, metric_key=key),
                           count=False, missing_ok=True)
        return max((int(m["step"]) for m in (found or {}).get("metrics", [])), default=-1)

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """One round's metrics at ``step``."""
        self._ready()
        now = _now_ms()
        batch = [dict(key=k, value=float(v), timestamp=now, step=int(step))
                 for k, v in values.items()]
        for i in range(0, len(batch), MAX_METRICS):
            self._call("POST", "runs/log-batch",
                       dict(run_id=self.run_id, metrics=batch[i:i + MAX_METRICS]))

    def log_artifact(self, path: Path) -> None:
        """Upload the file ``path`` to the run's artifacts under its own name."""
        path = Path(path)
        self._ready()
        if self.run_id is None:
            return self._skip("the MLflow run was never created")
        if self.artifact_path is None:
            return self._skip(f"the run's artifact URI is not served by {shown(self.uri)} "
                              "(start it with artifact serving, `mlflow server`'s default)")
        try:
            data = files.read_capped(path, MAX_ARTIFACT_BYTES, "an artifact", OSError)
        except OSError as exc:
            return self._skip(one_line(exc, kind=False, limit=160))
        url = (f"{self.uri}/api/2.0/mlflow-artifacts/artifacts/{self.artifact_path}/"
               f"{quote(path.name)}")
        self._request("PUT", url, data=data, timeout=self.timeout * (1 + len(data) / 2**20))

    def end(self, status: str) -> None:
        """Mark the run FINISHED, FAILED or KILLED."""
        self._ready()
        self._call("POST", "runs/update", dict(run_id=self.run_id, status=status,
                                               end_time=_now_ms()))

    def summary(self) -> str | None:
        """The one warning line of a run some of whose calls were lost, else None."""
        if not self.lost:
            return None
        return (f"mlflow: {self.lost} of {self.calls} calls lost (server {shown(self.uri)} "
                f"down or refusing: {self.reason}); the run's files are in its output directory")

    # ---- calls ---------------------------------------------------------------------------
    def _experiment(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return "0"  # MLflow's Default experiment
        found = self._call("GET", "experiments/get-by-name", dict(experiment_name=name),
                           count=False, missing_ok=True)
        if found is not None:
            return found["experiment"]["experiment_id"]
        made = self._call("POST", "experiments/create", dict(name=name), count=False)
        return made["experiment_id"] if made is not None else "0"

    def _opened(self, info: dict) -> None:
        self.run_id = info["run_id"]
        uri = urlsplit(info.get("artifact_uri") or "")
        self.artifact_path = uri.path.strip("/") if uri.scheme == "mlflow-artifacts" else None

    def _call(self, method: str, endpoint: str, body: dict, count: bool = True,
              missing_ok: bool = False) -> dict | None:
        """One REST call; its JSON answer, or None when it was lost. A call for a run that was
        never created is lost without a request; with ``missing_ok`` an answer that the thing
        does not exist is None, neither lost nor a reason to back off."""
        if "run_id" in body and body["run_id"] is None:
            return self._skip("the MLflow run was never created", count)
        url = f"{self.uri}/api/2.0/mlflow/{endpoint}"
        kwargs = dict(params=body) if method == "GET" else dict(json=body)
        return self._request(method, url, timeout=self.timeout, count=count,
                             missing_ok=missing_ok, **kwargs)

    def _request(self, method: str, url: str, count: bool = True, missing_ok: bool = False,
                 **kwargs) -> dict | None:
        import requests
        self.calls += count
        if time.monotonic() < self.quiet_until:
            self._lose(self.reason, count)  # backing off: a dead server costs no time
            return None
        try:
            answer = self.session.request(method, url, **kwargs)
        except requests.RequestException as exc:
            self._failed(one_line(exc, limit=160), count)
            return None
        if missing_ok and answer.status_code == 404:
            return None
        if answer.status_code >= 400:
            self._failed(f"HTTP {answer.status_code} {_error_code(answer)}".strip(), count)
            return None
        self.backoff = BACKOFF_S
        try:
            return answer.json() if answer.content else {}
        except ValueError:
            return {}

    def _failed(self, reason: str, count: bool) -> None:
        self._lose(reason, count)
        self.quiet_until = time.monotonic() + self.backoff
        self.backoff = min(MAX_BACKOFF_S, self.backoff * 2)

    def _skip(self, reason: str, count: bool = True) -> None:
        """A call lost without a request."""
        self.calls += count
        self._lose(reason, count)

    def _lose(self, reason: str | None, count: bool = True) -> None:
        self.lost += count
        self.reason = self.reason or reason


def write_record(out: Path, uri: str, run_id: str) -> None:
    """``OUT/mlflow.json``: which MLflow run this directory's run logs to."""
    checkpoint.write_atomic(Path(out) / RECORD, json.dumps(
        dict(tracking_uri=shown(uri), run_id=run_id), indent=1) + "\n")


def attach(out: str | Path, path: str | Path, uri: str,
           log: Callable[[str], None] = print) -> bool:
    """Log one more file of the run in ``out`` to its MLflow run (the hook for a file written
    after the run, such as the ONNX export's); whether it got through (if not: one warning
    line). The run's status is left as it is."""
    tracker = Tracker(uri, log)
    run_id = read_record(Path(out), uri)
    if run_id is None or not tracker.reopen(run_id):
        log(f"mlflow: {path} not logged: {Path(out) / RECORD} names no run on {shown(uri)}"
            + (f" ({tracker.reason})" if tracker.reason else ""))
        return False
    tracker.log_artifact(Path(path))
    if tracker.lost:
        log(tracker.summary())
    return not tracker.lost


def _auth_headers() -> dict:
    """MLflow's own credential variables, as its client reads them."""
    import base64
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = (os.environ.get("MLFLOW_TRACKING_USERNAME"),
                      os.environ.get("MLFLOW_TRACKING_PASSWORD"))
    if user and password:
        pair = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {"Authorization": f"Basic {pair}"}
    return {}


def _error_code(answer) -> str:
    try:
        return str(answer.json().get("error_code", ""))[:60]
    except (ValueError, AttributeError):
        return ""


def _now_ms() -> int:
    return int(time.time() * 1000)
