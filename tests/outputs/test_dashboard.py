"""The dashboard side of live metrics: the events a run publishes, the /training page (hostile
events included), and browser tests in which headless Chromium opens the dashboard of a running
job and finds the stage names."""
from __future__ import annotations

import io
import pickle
import threading
import time
import urllib.parse
import urllib.request

import distributed
import msgpack
import pytest
from hypothesis import given, settings

from pipeline import Config
from pipeline.cluster import connection as cluster
from pipeline.outputs import dashboard, live
from pipeline.core.config import ClusterConfig
from pipeline.training.loop import train as train_run
from tests.clusters import ARTIFACTS, browser_skip_reason, open_dashboard
from tests.outputs.conftest import HISTORY, history_st


# ---- events -----------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None, derandomize=True)
@given(history_st)
def test_events_keep_every_round(history):
    for h in history:
        event = dashboard.event_of(h, "r")
        assert msgpack.unpackb(msgpack.packb(event)) == event  # what log_event requires
        assert event["round"] == h["round"] and ("test_acc" in event) == ("test_acc" in h)


def test_scheduler_side_function_and_event_pickle_round_trip():
    assert pickle.loads(pickle.dumps(dashboard.install_page)) is dashboard.install_page
    event = dashboard.event_of(HISTORY[1], "ipm")
    assert pickle.loads(pickle.dumps(event)) == event


# ---- publishing and the page ------------------------------------------------------------------

def _get(url: str) -> str:
    # The in-process cluster's link names the inproc host; its dashboard binds 127.0.0.1.
    parts = urllib.parse.urlsplit(url)
    url = parts._replace(netloc=f"127.0.0.1:{parts.port}").geturl()
    return urllib.request.urlopen(url, timeout=30).read().decode()


def test_dashboard_events_publish_rounds_and_serve_the_page(dask_client):
    events = dashboard.dashboard_events(dask_client, run="unit-events")
    assert events.page_url == dask_client.dashboard_link.replace("/status", "/training")
    for line in HISTORY:
        events(line)
    got = dashboard.training_events(dask_client, "unit-events")
    assert [e["round"] for e in got] == [0, 1, 2, 3]
    assert got[1]["test_acc"] == pytest.approx(HISTORY[1]["test_acc"])
    assert got[0]["stage_seconds"] == {"train": 1.0, "waiting": 0.1}
    everything = [msg for _, msg in dask_client.get_events("all")]
    assert sum(m.get("action") == dashboard.ACTION and m.get("run") == "unit-events"
               for m in everything) == 4  # the /events page shows every round
    html = _get(events.page_url)  # a 404 raises; the Bokeh document itself loads in JS
    assert "Bokeh" in html and 'href="training"' in html
    assert dashboard.add_dashboard_page(dask_client) == events.page_url  # idempotent
    status = _get(dask_client.dashboard_link)
    assert status.count('href="training"') == 1  # one entry in every page's More... menu


def test_dashboard_events_find_the_default_client_at_the_first_round(dask_client):
    events = dashboard.DashboardEvents(run="unit-default", page=False)
    with dask_client.as_current():
        events(HISTORY[0])
    assert events.client is dask_client and events.page_url is None
    assert [e["round"] for e in dashboard.training_events(dask_client, "unit-default")] == [0]


def test_no_page_without_a_dashboard_but_events_still_flow():
    with distributed.LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0",
                                  scheduler_kwargs={"dashboard": False}) as cl, \
            distributed.Client(cl, set_as_default=False) as client:
        events = dashboard.dashboard_events(client, run="no-dashboard")
        events(HISTORY[0])
        assert events.page_url is None
        assert len(dashboard.training_events(client)) == 1


class _FakeScheduler:
    def __init__(self):
        self.events = []

    def get_events(self, topic):
        assert topic == dashboard.TOPIC
        return tuple(self.events)


def test_training_page_shows_the_latest_run():
    scheduler = _FakeScheduler()
    page = dashboard.TrainingPage(scheduler)
    page.update()
    assert page.train.data["epoch"] == [] and "no rounds" in page.div.text
    scheduler.events = [(float(i), dashboard.event_of(x, "first")) for i, x in enumerate(HISTORY)]
    page.update()
    assert page.train.data["round"] == [0, 1, 2, 3] and page.test.data["round"] == [1, 3]
    assert page.test.data["test_acc"] == pytest.approx([0.17, 0.21])
    scheduler.events.append((9.0, dashboard.event_of(HISTORY[0], "second")))
    page.update()
    assert page.train.data["round"] == [0] and page.test.data["epoch"] == []
    assert page.div.text.startswith("<b>second</b>: 1 round done (")


def test_training_page_says_round_x_of_n_eta_and_time_per_stage():
    scheduler = _FakeScheduler()
    page = dashboard.TrainingPage(scheduler)
    rows = [dict(line, seconds=10.0 * (i + 1), stage_seconds={"train": 6.0, "augment": 2.0})
            for i, line in enumerate(HISTORY[:2])]
    scheduler.events = [(float(i), dashboard.event_of(x, "ipm-20260101-120000", rounds=8))
                        for i, x in enumerate(rows)]
    page.update()
    text = page.div.text
    assert text.startswith("<b>ipm-20260101-120000</b>: 2 of 8 rounds done "
                           "(20 s so far, ETA 1 min 00 s)")
    assert "<br>round 1 epoch " in text  # one count: after round 1 (from 0), 2 rounds are done
    assert "train<br>12.0 s (75%)" in text and "augment<br>4.0 s (25%)" in text
    hostile = dashboard.event_of(dict(rows[0], round=7), "<script>x</script>", 8)
    scheduler.events.append((9.0, hostile))
    page.update()
    assert "<script>" not in page.div.text and "&lt;script&gt;" in page.div.text


def _points_sent(page) -> list:
    """The page in a Bokeh document; returns a list that collects, per change the document
    would send a browser, the number of plot points in it (a stream: its new rows; a whole
    ``data``: all of them)."""
    from bokeh.document import Document
    from bokeh.document.events import ColumnDataChangedEvent, ColumnsStreamedEvent, \
        ModelChangedEvent
    doc, sent = Document(), []
    doc.add_root(page.root)

    def count(event):
        if isinstance(event, ColumnsStreamedEvent):
            sent.append(len(event.data["round"]))
        elif isinstance(event, ColumnDataChangedEvent):
            sent.append(len(event.model.data["round"]))
        elif isinstance(event, ModelChangedEvent) and event.attr == "data":
            sent.append(len(event.new["round"]))
    doc.on_change(count)
    return sent


def test_the_training_page_sends_each_round_once_over_900_rounds():
    """A 900-round run updating the page after every round: each update sends its new points
    only (was every point of the run each time: 445,590 points over the run, and the page's test
    did not finish in its 120 s under load), and past MAX_POINTS a curve keeps every other
    point, so what a browser holds stays bounded. Counted in points, not seconds."""
    rounds, scheduler = 900, _FakeScheduler()
    page = dashboard.TrainingPage(scheduler)
    sent = _points_sent(page)
    for r in range(rounds):
        line = dict(round=r, epoch_float=r / 10, train_loss=2.0, train_acc=0.5, seconds=r + 1.0,
                    stage_seconds={"train": 1.0},
                    **({"test_loss": 2.0, "test_acc": 0.5} if r % 10 == 9 else {}))
        scheduler.events.append((float(r), dashboard.event_of(line, "long", rounds=rounds)))
        page.update()
        page.update()  # nothing new: nothing sent
    assert sum(sent) == rounds + rounds // 10, sum(sent)  # each point once
    assert page.train.data["round"] == list(range(rounds))
    assert page.div.text.startswith("<b>long</b>: 900 of 900 rounds done (15 min 00 s so far)")
    assert "train<br>900.0 s (100%)" in page.div.text
    for r in range(rounds, 2 * dashboard.MAX_POINTS + 1):  # past the bound: thinned
        line = dict(round=r, epoch_float=r / 10, train_loss=2.0, train_acc=0.5)
        scheduler.events.append((float(r), dashboard.event_of(line, "long", rounds=rounds)))
        page.update()
    held = page.train.data["round"]
    assert len(held) <= dashboard.MAX_POINTS and held[0] == 0 and held[1] - held[0] == 4, held[:3]
    assert sum(sent) < 4 * 2 * dashboard.MAX_POINTS, sum(sent)  # amortised: O(1) a round


def test_the_training_page_reads_only_new_events_when_the_log_rolls_over():
    """The scheduler keeps its last events only: once the oldest drop out, the page still
    reads each new round once (by time), and a new run label starts its plot afresh."""
    scheduler = _FakeScheduler()
    page = dashboard.TrainingPage(scheduler)
    for r in range(6):
        scheduler.events.append((float(r), dashboard.event_of(HISTORY[r % 4] | {"round": r}, "a")))
        scheduler.events = scheduler.events[-3:]  # a log of 3 events
        page.update()
    assert page.train.data["round"] == [0, 1, 2, 3, 4, 5]
    scheduler.events.append((9.0, dashboard.event_of(HISTORY[0], "b")))
    page.update()
    assert page.train.data["round"] == [0] and page.div.text.startswith("<b>b</b>: 1 round done")


def test_callbacks_see_every_round_of_a_real_run(dask_client):
    cfg = Config().replace(**{
        "data.source": "synthetic:128:32", "model.name": "small-cnn", "train.strategy": "ipm",
        "train.replicas": 2, "train.batch_size": 16, "average.mix_every": "2",
        "train.epochs": 1, "progress": False, "checkpoint_every": 0, "seed": 1})
    out = io.StringIO()
    plot = live.LivePlot("ipm", file=out)
    events = dashboard.dashboard_events(dask_client, run="unit-train", page=False)
    result = train_run(cfg, dask_client, on_round=live.compose(plot, events))
    assert plot.history == result.history and len(result.history) == 2
    assert len(out.getvalue().splitlines()) == 2
    published = dashboard.training_events(dask_client, "unit-train")
    tested = [e["test_acc"] for e in published if "test_acc" in e]
    assert tested == [result.history[-1]["test_acc"]]


# ---- hostile events (any client or task can publish on the topic) -----------------------------

XSS = '<img src=x onerror="alert(1)"><script>alert(2)</script>'
MALFORMED = [
    "not a dict", 42, None, ["a", "list"],
    {"run": "r"},  # no metrics at all
    {"run": "r", "round": "1", "epoch_float": 0.5, "train_loss": 2.0, "train_acc": 0.1},
    {"run": "r", "round": 1, "epoch_float": "<b>", "train_loss": 2.0, "train_acc": 0.1},
    {"run": "r", "round": 1, "epoch_float": 0.5, "train_loss": float("nan"), "train_acc": 0.1},
    {"run": "r", "round": 1, "epoch_float": 0.5, "train_loss": 2.0, "train_acc": 0.1,
     "test_acc": 0.2},  # a test accuracy without its loss
    {"run": "r", "round": True, "epoch_float": 0.5, "train_loss": 2.0, "train_acc": 0.1},
]


def test_training_page_escapes_the_label_and_skips_malformed_events():
    scheduler = _FakeScheduler()
    page = dashboard.TrainingPage(scheduler)
    good = dashboard.event_of(HISTORY[1], XSS)
    good["train_acc"] = 0.5
    scheduler.events = [(1.0, good)] + [(2.0 + i, m) for i, m in enumerate(MALFORMED)] + \
        ["not a pair", (9.0,)]
    page.update()  # never raises: a malformed event cannot take the page down
    assert page.train.data["round"] == [1] and page.test.data["round"] == [1]
    assert "<script" not in page.div.text and "<img" not in page.div.text
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in page.div.text
    assert page.div.text.startswith("<b>&lt;img src=x onerror=&quot;alert(1)&quot;&gt;")
    scheduler.events = [(1.0, m) for m in MALFORMED]
    page.update()
    assert page.train.data["round"] == [1]  # nothing well formed: the last good plot stays


def test_the_page_serves_200_with_hostile_events_published(dask_client):
    events = dashboard.dashboard_events(dask_client, run=XSS)
    events(HISTORY[0])
    for msg in MALFORMED:
        dask_client.log_event(dashboard.TOPIC, msg)
    assert dashboard.training_events(dask_client)[-1] == MALFORMED[-1]
    html = _get(events.page_url)  # an exception building the document would be an HTTP 500
    assert "Bokeh" in html and "<script>alert" not in html


# ---- in a browser -----------------------------------------------------------------------------

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
        events = dashboard.dashboard_events(client, run="browser-test")
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
            dash.goto("/" + dashboard.PAGE)
            rounds = dash.wait_for(lambda: set(_column(dash, "round")), {0, 1, 2}, timeout=60)
            test_acc = _column(dash, "test_acc")
            menu = dash.page.locator(f'a[href="{dashboard.PAGE}"]').count()  # "More..." links it
            dash.screenshot(ARTIFACTS / "dashboard-training-page.png")
            dash.goto("/events")
            actions = dash.wait_for(lambda: set(_column(dash, "action")), {dashboard.ACTION},
                                    timeout=30)
            dash.goto("/individual-fine-performance-metrics")
            spans = dash.wait_for(dash.span_tags, STAGES, timeout=30)
            dash.screenshot(ARTIFACTS / "dashboard-training-spans.png")  # time by stage
            stop.set()
            job.join(timeout=60)
            running_at_end = job.is_alive()
        published = dashboard.training_events(client, "browser-test")
    assert not errors, errors
    assert not running_at_end, "the run did not stop after on_round raised"
    assert running_at_shot, "the run ended before the screenshot: make it longer"
    assert STAGES <= names, f"task stream shows {sorted(names)}"
    assert {"augment", "train", "average"} <= progress, f"progress bars show {sorted(progress)}"
    assert {0, 1, 2} <= rounds, f"/training shows rounds {sorted(rounds)}"
    assert test_acc and all(0 <= a <= 1 for a in test_acc)
    assert menu == 1, "no Training entry in the dashboard's More... menu"
    assert dashboard.ACTION in actions, f"/events shows {sorted(actions)}"
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
    /training page names the run and says "N of M rounds done" with an ETA; opening the Groups page
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
            dash.goto("/" + dashboard.PAGE)
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
    assert f"<b>{out.name}</b>: " in text and " of 64 rounds done (" in text and "ETA" in text, \
        texts
    assert "time per stage" in text and "train<br>" in text, texts
