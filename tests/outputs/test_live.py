"""Live training metrics: the notebook plot (in a real kernel), the scheduler events and the /training page."""
from __future__ import annotations

import io
import os
import pickle
import urllib.parse
import urllib.request

import distributed
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import Config
from pipeline.outputs import live
from pipeline.training.loop import train
from tests.clusters import REPO


def _line(r: int, tested: bool = False) -> dict:
    line = {"round": r, "epoch": r // 4, "epoch_float": (r + 1) / 4, "step": 4 * (r + 1),
            "train_loss": 2.3 - 0.1 * r, "train_acc": 0.1 + 0.02 * r, "lr": 0.01, "images": 64,
            "seconds": 1.5 * (r + 1), "bytes_averaged": 155728,
            "stage_seconds": {"train": 1.0, "waiting": 0.1}}
    if tested:
        line.update(test_loss=2.2 - 0.1 * r, test_acc=0.15 + 0.02 * r)
    return line


HISTORY = [_line(r, tested=r % 2 == 1) for r in range(4)]


# ---- pure helpers -----------------------------------------------------------------------------

def test_live_figure_draws_train_and_test_series():
    fig = live.live_figure(HISTORY, "ipm")
    loss_ax, acc_ax = fig.axes
    train_line, test_line = acc_ax.get_lines()
    assert list(train_line.get_xdata()) == [0.25, 0.5, 0.75, 1.0]
    assert list(test_line.get_xdata()) == [0.5, 1.0]
    assert list(test_line.get_ydata()) == pytest.approx([0.17, 0.21])
    assert fig.get_suptitle().startswith("ipm: round 3 epoch 1.00")
    fig.savefig(io.BytesIO(), format="png")  # renders without pyplot (Agg)


def test_live_figure_of_no_rounds():
    assert "waiting" in live.live_figure([]).get_suptitle()


line_st = st.fixed_dictionaries(
    {"round": st.integers(0, 10**6), "epoch_float": st.floats(0, 1e3),
     "train_loss": st.floats(0, 1e3), "train_acc": st.floats(0, 1)},
    optional={"test_loss": st.floats(0, 1e3), "seconds": st.floats(0, 1e5),
              "stage_seconds": st.dictionaries(st.sampled_from(["train", "average"]),
                                               st.floats(0, 1e3))})


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(line_st.map(lambda d: {**d, **({"test_acc": 0.5} if "test_loss" in d else {})}),
                max_size=8))
def test_split_series_and_events_keep_every_round(history):
    train_cols, test_cols = live.split_series(history)
    assert len(train_cols["epoch"]) == len(train_cols["loss"]) == len(history)
    assert len(test_cols["acc"]) == sum("test_acc" in h for h in history)
    for h in history:
        event = live.event_of(h, "r")
        assert msgpack.unpackb(msgpack.packb(event)) == event  # what log_event requires
        assert event["round"] == h["round"] and ("test_acc" in event) == ("test_acc" in h)
        live.format_line(h)


def test_scheduler_side_function_and_event_pickle_round_trip():
    assert pickle.loads(pickle.dumps(live.install_page)) is live.install_page
    event = live.event_of(HISTORY[1], "ipm")
    assert pickle.loads(pickle.dumps(event)) == event


# ---- LivePlot ---------------------------------------------------------------------------------

def test_live_plot_prints_a_line_per_round_outside_a_kernel():
    out = io.StringIO()
    plot = live.LivePlot(file=out)
    assert plot.display is False  # pytest is not a Jupyter kernel
    for line in HISTORY[:2]:
        plot(line)
    assert out.getvalue().splitlines() == [live.format_line(x) for x in HISTORY[:2]]
    assert plot.history == HISTORY[:2]
    assert len(plot.figure().axes) == 2


def _run_notebook(cells: list[str], tmp_path, timeout: int = 120):
    import nbclient
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    return nb


def test_live_plot_updates_one_output_in_place_in_a_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO),
                                                                   os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = _run_notebook([
        "from pipeline.outputs import live\n"
        f"history = {HISTORY!r}\n"
        "plot = live.LivePlot('demo')\n"
        "for line in history:\n"
        "    plot(line)\n"
        "print(plot.display, len(plot.history))"], tmp_path)
    outputs = nb.cells[0].outputs
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    texts = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert texts.strip() == "True 4"
    assert len(images) == 1, [o.output_type for o in outputs]  # updated, not appended
    assert images[0].output_type == "display_data"
    assert images[0].data["image/png"][:8] != ""


# ---- the dashboard ----------------------------------------------------------------------------

def _get(url: str) -> str:
    # The in-process cluster's link names the inproc host; its dashboard binds 127.0.0.1.
    parts = urllib.parse.urlsplit(url)
    url = parts._replace(netloc=f"127.0.0.1:{parts.port}").geturl()
    return urllib.request.urlopen(url, timeout=30).read().decode()


def test_dashboard_events_publish_rounds_and_serve_the_page(dask_client):
    events = live.dashboard_events(dask_client, run="unit-events")
    assert events.page_url == dask_client.dashboard_link.replace("/status", "/training")
    for line in HISTORY:
        events(line)
    got = live.training_events(dask_client, "unit-events")
    assert [e["round"] for e in got] == [0, 1, 2, 3]
    assert got[1]["test_acc"] == pytest.approx(HISTORY[1]["test_acc"])
    assert got[0]["stage_seconds"] == {"train": 1.0, "waiting": 0.1}
    everything = [msg for _, msg in dask_client.get_events("all")]
    assert sum(m.get("action") == live.ACTION and m.get("run") == "unit-events"
               for m in everything) == 4  # the /events page shows every round
    html = _get(events.page_url)  # a 404 raises; the Bokeh document itself loads in JS
    assert "Bokeh" in html and 'href="training"' in html
    assert live.add_dashboard_page(dask_client) == events.page_url  # idempotent
    status = _get(dask_client.dashboard_link)
    assert status.count('href="training"') == 1  # one entry in every page's More... menu


def test_dashboard_events_find_the_default_client_at_the_first_round(dask_client):
    events = live.DashboardEvents(run="unit-default", page=False)
    with dask_client.as_current():
        events(HISTORY[0])
    assert events.client is dask_client and events.page_url is None
    assert [e["round"] for e in live.training_events(dask_client, "unit-default")] == [0]


def test_no_page_without_a_dashboard_but_events_still_flow():
    with distributed.LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0",
                                  scheduler_kwargs={"dashboard": False}) as cl, \
            distributed.Client(cl, set_as_default=False) as client:
        events = live.dashboard_events(client, run="no-dashboard")
        events(HISTORY[0])
        assert events.page_url is None
        assert len(live.training_events(client)) == 1


class _FakeScheduler:
    def __init__(self):
        self.events = []

    def get_events(self, topic):
        assert topic == live.TOPIC
        return tuple(self.events)


def test_training_page_shows_the_latest_run():
    scheduler = _FakeScheduler()
    page = live.TrainingPage(scheduler)
    page.update()
    assert page.train.data["epoch"] == [] and "no rounds" in page.div.text
    scheduler.events = [(float(i), live.event_of(x, "first")) for i, x in enumerate(HISTORY)]
    page.update()
    assert page.train.data["round"] == [0, 1, 2, 3] and page.test.data["round"] == [1, 3]
    assert page.test.data["test_acc"] == pytest.approx([0.17, 0.21])
    scheduler.events.append((9.0, live.event_of(HISTORY[0], "second")))
    page.update()
    assert page.train.data["round"] == [0] and page.test.data["epoch"] == []
    assert page.div.text.startswith("<b>second</b>: round 1 (")


def test_training_page_says_round_x_of_n_eta_and_time_per_stage():
    scheduler = _FakeScheduler()
    page = live.TrainingPage(scheduler)
    rows = [dict(line, seconds=10.0 * (i + 1), stage_seconds={"train": 6.0, "augment": 2.0})
            for i, line in enumerate(HISTORY[:2])]
    scheduler.events = [(float(i), live.event_of(x, "ipm-20260101-120000", rounds=8))
                        for i, x in enumerate(rows)]
    page.update()
    text = page.div.text
    assert text.startswith("<b>ipm-20260101-120000</b>: round 2 of 8 (20 s so far, ETA 1 min 00 s)")
    assert "train<br>12.0 s (75%)" in text and "augment<br>4.0 s (25%)" in text
    scheduler.events.append((9.0, live.event_of(dict(rows[0], round=7), "<script>x</script>", 8)))
    page.update()
    assert "<script>" not in page.div.text and "&lt;script&gt;" in page.div.text


def test_callbacks_see_every_round_of_a_real_run(dask_client):
    cfg = Config().replace(**{
        "data.source": "synthetic:128:32", "model.name": "small-cnn", "train.strategy": "ipm",
        "train.replicas": 2, "train.batch_size": 16, "average.mix_every": "2",
        "train.epochs": 1, "progress": False, "checkpoint_every": 0, "seed": 1})
    out = io.StringIO()
    plot = live.LivePlot("ipm", file=out)
    events = live.dashboard_events(dask_client, run="unit-train", page=False)
    result = train(cfg, dask_client, on_round=live.compose(plot, events))
    assert plot.history == result.history and len(result.history) == 2
    assert len(out.getvalue().splitlines()) == 2
    published = live.training_events(dask_client, "unit-train")
    assert [e["test_acc"] for e in published if "test_acc" in e] == [result.history[-1]["test_acc"]]


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
    page = live.TrainingPage(scheduler)
    good = live.event_of(HISTORY[1], XSS)
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
    events = live.dashboard_events(dask_client, run=XSS)
    events(HISTORY[0])
    for msg in MALFORMED:
        dask_client.log_event(live.TOPIC, msg)
    assert live.training_events(dask_client)[-1] == MALFORMED[-1]
    html = _get(events.page_url)  # an exception building the document would be an HTTP 500
    assert "Bokeh" in html and "<script>alert" not in html
