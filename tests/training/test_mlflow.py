"""--mlflow URI against a real `mlflow server` (SQLite backend, proxied local artifacts) on a
loopback port: the run read back through MLflow's REST API, a resume going on in the same MLflow
run, and servers that are down, refusing or silent never stopping the training."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from pipeline.cli import main
from pipeline.core.config import Config
from pipeline.outputs import mlflow_tracking
from pipeline.training import train
from tests.clusters import free_port
from tests.helpers import make_config

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None and not IN_CI,
    reason="mlflow is not installed (pip install -e '.[mlflow]') and CI is not set")

BASE = {"data.source": "synthetic:64:16", "model.name": "small-cnn", "train.strategy": "single",
        "train.replicas": 1, "train.batch_size": 16, "train.epochs": 1, "progress": False,
        "average.mix_every": "1",  # 4 rounds of one step: checkpoints at rounds 1 and 3
        "checkpoint_every": 2, "seed": 1}
START_S = 90  # `mlflow server` answers /health after ~8 s on an idle 2-core machine


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """The URI of an `mlflow server` on 127.0.0.1 (its process group killed at the end, also
    when a test or the start fails)."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "wb")
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", (root / "artifacts").as_uri()],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while not _healthy(uri):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (root / "server.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"mlflow server did not start (exit {proc.poll()}):\n{tail}")
            time.sleep(0.3)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def _healthy(uri: str) -> bool:
    try:
        return requests.get(f"{uri}/health", timeout=1).ok
    except requests.RequestException:
        return False


def _api(uri: str, endpoint: str, **params) -> dict:
    answer = requests.get(f"{uri}/api/2.0/mlflow/{endpoint}", params=params, timeout=10)
    answer.raise_for_status()
    return answer.json()


def _run(uri: str, run_id: str) -> tuple[dict, dict]:
    run = _api(uri, "runs/get", run_id=run_id)["run"]
    return run["info"], {p["key"]: p["value"] for p in run["data"].get("params", [])}


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    found = _api(uri, "metrics/get-history", run_id=run_id, metric_key=key).get("metrics", [])
    return [(m["step"], m["value"]) for m in found]


def _artifacts(uri: str, run_id: str) -> dict[str, int]:
    found = _api(uri, "artifacts/list", run_id=run_id).get("files", [])
    return {f["path"]: f.get("file_size") for f in found}


def _artifact(uri: str, info: dict, name: str) -> bytes:
    path = info["artifact_uri"].split(":", 1)[1].strip("/")
    answer = requests.get(f"{uri}/api/2.0/mlflow-artifacts/artifacts/{path}/{name}", timeout=10)
    answer.raise_for_status()
    return answer.content


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _record(out: Path) -> str:
    return json.loads((out / mlflow_tracking.RECORD).read_text())["run_id"]


def test_the_run_is_read_back_through_the_rest_api(mlflow_server, dask_client, tmp_path):
    out, said = tmp_path / "run", []
    train(make_config(BASE, out=str(out), mlflow=mlflow_server), client=dask_client,
          log=said.append)
    assert not [x for x in said if x.startswith("mlflow")], said
    info, params = _run(mlflow_server, _record(out))
    assert info["status"] == "FINISHED" and info["run_name"] == "run"
    assert params["train.batch_size"] == "16" and params["data.source"] == "synthetic:64:16"
    assert params["seed"] == "1" and params["data.cache_dir"] == "null"
    assert "mlflow" not in params  # the server's address is not a parameter of the run
    lines = _lines(out)
    assert _history(mlflow_server, info["run_id"], "loss/train") == [
        (x["step"], pytest.approx(x["train_loss"])) for x in lines]
    stages = _history(mlflow_server, info["run_id"], "seconds/train")
    assert [s for s, _ in stages] == [x["step"] for x in lines]
    assert [v for _, v in stages] == pytest.approx([x["stage_seconds"]["train"] for x in lines])
    assert _history(mlflow_server, info["run_id"], "accuracy/test")  # the epoch's evaluation
    files = _artifacts(mlflow_server, info["run_id"])
    assert set(files) >= {"config.json", "model.npz", "curves.png", "summary.json"}
    assert _artifact(mlflow_server, info, "model.npz") == (out / "model.npz").read_bytes()
    assert json.loads(_artifact(mlflow_server, info, "config.json"))["mlflow"] == mlflow_server

    # the ONNX export of a tracked run joins its artifacts (pipeline.export calls attach)
    if not os.environ.get("CI"):
        pytest.importorskip("onnx")  # the [onnx] extra (CI installs it)
    import pipeline
    exported = pipeline.export(out, tmp_path / "model.onnx")
    assert _artifact(mlflow_server, info, "model.onnx") == exported.read_bytes()
    assert _run(mlflow_server, info["run_id"])[0]["status"] == "FINISHED"


def test_a_resume_goes_on_in_the_same_mlflow_run(mlflow_server, dask_client, tmp_path):
    out = tmp_path / "run"
    cfg = make_config(BASE, out=str(out), mlflow=mlflow_server)
    train(cfg, client=dask_client)
    run_id = _record(out)
    first = _history(mlflow_server, run_id, "loss/train")
    newest = sorted((out / "checkpoints").iterdir())[-1]
    shutil.rmtree(newest)  # so the resume recomputes the rounds after the one before
    train(cfg.replace(**{"train.epochs": 2}), client=dask_client, resume=True)
    assert _record(out) == run_id
    info, params = _run(mlflow_server, run_id)
    assert info["status"] == "FINISHED" and params["train.epochs"] == "1"  # as first logged
    logged = _history(mlflow_server, run_id, "loss/train")
    assert logged[:len(first)] == first  # the recomputed rounds are not logged twice
    assert [s for s, _ in logged] == [x["step"] for x in _lines(out)]
    runs = requests.post(f"{mlflow_server}/api/2.0/mlflow/runs/search", timeout=10,
                         json={"experiment_ids": ["0"], "max_results": 1000}).json()["runs"]
    assert sum(r["info"]["run_name"] == "run" and r["info"]["run_id"] == run_id
               for r in runs) == 1


@contextlib.contextmanager
def _silent_server():
    """A port that takes connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("server", ["down", "refusing", "silent"])
def test_a_server_that_is_down_never_stops_the_training(server, mlflow_server, dask_client,
                                                         tmp_path, monkeypatch):
    monkeypatch.setattr(mlflow_tracking, "TIMEOUT_S", 0.5)
    out, said = tmp_path / "run", []
    with contextlib.ExitStack() as stack:
        uri = {"down": lambda: f"http://127.0.0.1:{free_port()}",
               "refusing": lambda: f"{mlflow_server}/no/such/prefix",
               "silent": lambda: stack.enter_context(_silent_server())}[server]()
        start = time.monotonic()
        result = train(make_config(BASE, out=str(out), mlflow=uri), client=dask_client,
                       log=said.append)
        took = time.monotonic() - start
    assert result.status == "done" and (out / "model.npz").is_file()
    lost = [x for x in said if x.startswith("mlflow")]
    assert len(lost) == 1, said
    assert f"calls lost (server {uri} down or refusing" in lost[0]
    n, m = map(int, lost[0].split()[1:4:2])
    assert 0 < n <= m
    assert not (out / mlflow_tracking.RECORD).exists()
    assert took < 60, took  # one timeout, then the back-off: not a timeout per call


def test_a_server_that_comes_back_gets_the_rest_of_the_run(mlflow_server, monkeypatch):
    monkeypatch.setattr(mlflow_tracking, "BACKOFF_S", 0.05)
    started, said = [], []
    tracker = mlflow_tracking.Tracker(mlflow_server, said.append, on_start=started.append)
    real, down = tracker.session.request, [True]

    def request(*args, **kwargs):
        if down[0]:
            raise requests.ConnectionError("Connection refused")
        return real(*args, **kwargs)
    tracker.session.request = request
    assert tracker.start(None, "late", {"seed": "0"}) is None
    tracker.log_metrics(0, {"loss/train": 2.0})  # backing off: lost without a request
    down[0] = False
    time.sleep(0.1)
    tracker.log_metrics(1, {"loss/train": 1.5})  # creates the run first
    tracker.end("FINISHED")
    assert started == [tracker.run_id] and said == []
    info, params = _run(mlflow_server, tracker.run_id)
    assert info["status"] == "FINISHED" and params == {"seed": "0"}
    assert _history(mlflow_server, tracker.run_id, "loss/train") == [(1, 1.5)]
    assert (tracker.lost, tracker.calls) == (2, 6)
    assert tracker.summary().startswith(f"mlflow: 2 of 6 calls lost (server {mlflow_server} ")
    assert "Connection refused" in tracker.summary()


def test_the_readme_commands_train_and_resume_into_one_mlflow_run(mlflow_server, scheduler,
                                                                  tmp_path, capsys):
    out = tmp_path / "tracked"
    args = ["--scheduler", scheduler, "--no-progress"]
    assert main(["train", "--data", "synthetic:64:16", "--model", "small-cnn", "--strategy",
                 "single", "--batch-size", "16", "--epochs", "1", "--out", str(out),
                 "--mlflow", mlflow_server, *args]) == 0
    run_id = _record(out)
    assert main(["train", "--resume", str(out), "--epochs", "2", *args]) == 0  # config.json's URI
    assert _record(out) == run_id
    assert "mlflow" not in capsys.readouterr().err
    steps = [s for s, _ in _history(mlflow_server, run_id, "loss/train")]
    assert steps[-1] == _lines(out)[-1]["step"] and len(steps) >= len(_lines(out))
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["train", "--resume", str(out), "--epochs", "3", "--mlflow", dead, *args]) == 0
    said = [x for x in capsys.readouterr().err.splitlines() if "mlflow" in x]
    assert len(said) == 1 and said[0].startswith("mlflow: ") and dead in said[0], said
    assert _record(out) == run_id  # the record of the first server stays


def test_mlflow_takes_an_http_uri_only():
    with pytest.raises(ValueError, match="mlflow must be an http:// or https://"):
        Config(mlflow="file:///tmp/mlruns").validate()
    assert Config(mlflow="https://mlflow.example:5000/base").validate().mlflow
    with pytest.raises(ValueError, match="MLFLOW_TRACKING_USERNAME") as caught:
        Config(mlflow="https://me:secret@mlflow.example").validate()
    assert "secret" not in str(caught.value)
