"""Browser tests: headless Chromium opens the dashboard of a running job and finds the stage names."""
from __future__ import annotations

import threading
import time

import distributed
import pytest

from pipeline import Config
from pipeline.cluster import connection as cluster
from pipeline.outputs import live
from pipeline.core.config import ClusterConfig
from pipeline.training.loop import train as train_run
from tests.clusters import ARTIFACTS, browser_skip_reason, open_dashboard

STAGES = {"load", "augment", "train", "average", "evaluate"}
TOKEN = "0123abcd"  # an 8-hex run token: key_split drops it, so the dashboard shows the bare stage


# Stand-ins for the pipeline's stages: same names, same key shapes, a little sleep so that the
# task stream has something to draw. The real training job can replace `stage_graph`.
def load(i):
    time.sleep(0.05)
    return i


def augment(x, r, k):
    time.sleep(0.1)
    return x + r


def train(batch, state, r, k):
    time.sleep(0.2)
    return batch + (state or 0) + k


def average(*xs):
    time.sleep(0.05)
    return sum(xs) / len(xs)


def evaluate(x):
    time.sleep(0.05)
    return x


def submit_stage_job(client, token: str = TOKEN, replicas: int = 4, rounds: int = 2,
                     fan_in: int = 2) -> list:
    """Submit a job shaped like a training run, each stage in its `distributed.span`, keys named
    by stage; returns the ("evaluate-T", r) futures.

    ("load-T", k) -> ("augment-T", r, k) -> ("train-T", r, k) -> ("average-T", r, level, i) tree
    -> ("evaluate-T", r); round r + 1 augments the loaded shard again and trains it from the
    round-r average.
    """
    def submit(func, *args, key):
        return client.submit(func, *args, key=key, pure=False)

    with distributed.span("load"):
        loaded = [submit(load, k, key=(f"load-{token}", k)) for k in range(replicas)]
    state, outputs = None, []
    for r in range(rounds):
        with distributed.span("augment"):
            shards = [submit(augment, loaded[k], r, k, key=(f"augment-{token}", r, k))
                      for k in range(replicas)]
        with distributed.span("train"):
            level = [submit(train, shards[k], state, r, k, key=(f"train-{token}", r, k))
                     for k in range(replicas)]
        with distributed.span("average"):
            depth = 0
            while len(level) > 1:
                groups = [level[i:i + fan_in] for i in range(0, len(level), fan_in)]
                level = [submit(average, *group, key=(f"average-{token}", r, depth, i))
                         for i, group in enumerate(groups)]
                depth += 1
        state = level[0]
        with distributed.span("evaluate"):
            outputs.append(submit(evaluate, state, key=(f"evaluate-{token}", r)))
    return outputs


@pytest.mark.browser
@pytest.mark.skipif(browser_skip_reason() is not None, reason=str(browser_skip_reason()))
def test_dashboard_shows_the_stages():
    shot = ARTIFACTS / "dashboard.png"
    with cluster.connect(ClusterConfig(workers=2, threads_per_worker=1)) as client:
        link = cluster.describe(client)["dashboard"]
        assert link.startswith("http://127.0.0.1:")
        # Open the page first: that starts the scheduler's task-stream recording.
        with open_dashboard(link) as dash:
            futures = submit_stage_job(client)
            names = dash.wait_for_stages(STAGES, timeout=30)
            progress = dash.progress_names()
            dash.screenshot(shot)  # mid-run: progress bars and task stream, named by stage
            results = client.gather(futures)
            dash.goto("/individual-fine-performance-metrics")
            spans = dash.wait_for(dash.span_tags, STAGES, timeout=30)
            dash.screenshot(ARTIFACTS / "dashboard-metrics.png")  # time by stage and activity
    assert STAGES <= names, f"task stream shows {sorted(names)}"
    assert STAGES <= progress, f"progress bars show {sorted(progress)}"
    assert STAGES <= spans, f"span tags: {sorted(spans)}"
    assert len(results) == 2
    assert shot.stat().st_size > 10_000  # a real PNG of the page, not an empty one


# Values of one column from every Bokeh data source on the page that has it (BokehJS 3: plain data).
_COLUMN_JS = """(column) => {
  const values = [];
  for (const doc of (window.Bokeh && Bokeh.documents) || []) {
    for (const model of doc.all_models) {
      const data = model.data;
      if (data && !(data instanceof Map) && column in data) values.push(...Array.from(data[column]));
    }
  }
  return values;
}"""


def _column(dash, name: str) -> list:
    return dash.page.evaluate(_COLUMN_JS, name)


class _Stop(Exception):
    """Raised from on_round to end the background run once the browser has seen enough."""


def _training_config() -> Config:
    # ~1 s rounds on 2 cores; epochs is a ceiling: the test stops the run after its checks.
    return Config().replace(**{
        "data.source": "synthetic:512:128", "model.name": "small-cnn", "train.strategy": "ipm",
        "train.replicas": 2, "train.batch_size": 16, "average.mix_every": "4",
        "train.epochs": 20, "eval_every": 2, "checkpoint_every": 0, "progress": False,
        "seed": 5})


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.skipif(browser_skip_reason() is not None, reason=str(browser_skip_reason()))
def test_dashboard_of_a_running_training_job():
    """A real `train` in a background thread: the task stream names its stages, the run's
    metrics reach the /training page and the /events page while it goes."""
    stop, seen, errors = threading.Event(), [], []

    def on_round(line):
        seen.append(line)
        if stop.is_set():
            raise _Stop

    with cluster.connect(ClusterConfig(workers=2, threads_per_worker=1)) as client:
        events = live.dashboard_events(client, run="browser-test")
        assert events.page_url == cluster.describe(client)["dashboard"].replace("status", "training")

        def run():
            try:
                train_run(_training_config(), client, on_round=live.compose(events, on_round))
            except _Stop:
                pass
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        # Open the page first: that starts the scheduler's task-stream recording, so the load-
        # tasks at the start of the run are in the stream too.
        with open_dashboard(cluster.describe(client)["dashboard"]) as dash:
            job = threading.Thread(target=run, name="training-run", daemon=True)
            job.start()
            names = dash.wait_for_stages(STAGES, timeout=60)
            progress = dash.progress_names()
            running_at_shot = job.is_alive()
            dash.screenshot(ARTIFACTS / "dashboard-training.png")
            dash.goto("/" + live.PAGE)
            rounds = dash.wait_for(lambda: set(_column(dash, "round")), {0, 1, 2}, timeout=60)
            test_acc = _column(dash, "test_acc")
            menu = dash.page.locator(f'a[href="{live.PAGE}"]').count()  # "More..." links it
            dash.screenshot(ARTIFACTS / "dashboard-training-page.png")
            dash.goto("/events")
            actions = dash.wait_for(lambda: set(_column(dash, "action")), {live.ACTION},
                                    timeout=30)
            dash.goto("/individual-fine-performance-metrics")
            spans = dash.wait_for(dash.span_tags, STAGES, timeout=30)
            dash.screenshot(ARTIFACTS / "dashboard-training-spans.png")  # time by stage
            stop.set()
            job.join(timeout=60)
            running_at_end = job.is_alive()
        published = live.training_events(client, "browser-test")
    assert not errors, errors
    assert not running_at_end, "the run did not stop after on_round raised"
    assert running_at_shot, "the run ended before the screenshot: make it longer"
    assert STAGES <= names, f"task stream shows {sorted(names)}"
    assert {"augment", "train", "average"} <= progress, f"progress bars show {sorted(progress)}"
    assert {0, 1, 2} <= rounds, f"/training shows rounds {sorted(rounds)}"
    assert test_acc and all(0 <= a <= 1 for a in test_acc)
    assert menu == 1, "no Training entry in the dashboard's More... menu"
    assert live.ACTION in actions, f"/events shows {sorted(actions)}"
    assert STAGES <= spans, f"span tags: {sorted(spans)}"
    assert [e["round"] for e in published] == [line["round"] for line in seen]
    assert (ARTIFACTS / "dashboard-training.png").stat().st_size > 10_000


def test_browser_tests_skip_only_outside_ci(monkeypatch, tmp_path):
    from tests import clusters
    monkeypatch.setattr(clusters, "CHROMIUM", str(tmp_path / "no-chromium"))
    monkeypatch.delenv("CI", raising=False)
    assert "no-chromium is absent" in clusters.browser_skip_reason()
    monkeypatch.setenv("CI", "true")
    assert clusters.browser_skip_reason() is None  # under CI a missing browser fails the test


_DIV_TEXTS_JS = """() => {
  const texts = [];
  for (const doc of (window.Bokeh && Bokeh.documents) || []) {
    for (const model of doc.all_models) {
      if (typeof model.text === "string") texts.push(model.text);
    }
  }
  return texts;
}"""


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.skipif(browser_skip_reason() is not None, reason=str(browser_skip_reason()))
def test_a_cli_run_has_its_training_page_and_keeps_dashboard_errors_out(tmp_path):
    """`python -m pipeline train` on its embedded cluster, dashboard at --dashboard-address: the
    /training page names the run and says "round X of N" with an ETA; opening the Groups page
    (whose KeyErrors on our stage groups used to scroll into the terminal) leaves the training
    output clean; the web errors land in OUT/dashboard.log."""
    import os
    import subprocess
    import sys

    from tests.clusters import REPO, free_port
    port, out = free_port(), tmp_path / "cli-run"
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "train", "--data", "synthetic:1024:128", "--replicas",
         "2", "--batch-size", "8", "--mix-every", "4", "--epochs", "4", "--lr", "0.02",
         "--workers", "1", "--no-progress", "--dashboard-address", f"127.0.0.1:{port}",
         "--out", str(out)], cwd=str(REPO), env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        with open_dashboard(f"http://127.0.0.1:{port}/status") as dash:
            # /groups may answer 500 (distributed's KeyError): no Bokeh document to wait for.
            dash.page.goto(f"http://127.0.0.1:{port}/groups", timeout=30_000)
            dash.page.wait_for_timeout(1500)
            dash.goto("/" + live.PAGE)
            texts = dash.wait_for(lambda: {t for t in dash.page.evaluate(_DIV_TEXTS_JS)
                                           if " of " in t}, timeout=60)
            dash.screenshot(ARTIFACTS / "dashboard-cli-training-page.png")
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
    assert f"dashboard http://127.0.0.1:{port}/status" in stderr
    text = " ".join(texts)
    assert f"<b>{out.name}</b>: round " in text and " of 64 (" in text and "ETA" in text, texts
    assert "time per stage" in text and "train<br>" in text, texts
