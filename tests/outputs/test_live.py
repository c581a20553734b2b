"""The notebook side of live metrics: the metrics line, the figure, LivePlot (in a real kernel)."""
from __future__ import annotations

import io
import os

import pytest
from hypothesis import given, settings

from pipeline.outputs import live
from tests.clusters import REPO
from tests.outputs.conftest import HISTORY, history_st


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




@settings(max_examples=60, deadline=None, derandomize=True)
@given(history_st)
def test_split_series_and_lines_keep_every_round(history):
    train_cols, test_cols = live.split_series(history)
    assert len(train_cols["epoch"]) == len(train_cols["loss"]) == len(history)
    assert len(test_cols["acc"]) == sum("test_acc" in h for h in history)
    for h in history:
        live.format_line(h)


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


def test_the_dashboard_names_still_reach_through_live_for_one_release():
    from pipeline.outputs import dashboard
    with pytest.warns(DeprecationWarning, match="moved to pipeline.outputs.dashboard"):
        assert live.dashboard_events is dashboard.dashboard_events
