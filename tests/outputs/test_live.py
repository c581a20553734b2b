"""The notebook side of live metrics: the metrics line, the figure, LivePlot (in a real kernel)."""
from __future__ import annotations

import io
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.outputs import live
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
# Rounds as train emits them: a test accuracy exactly where the round has a test loss.
history_st = st.lists(
    line_st.map(lambda d: {**d, **({"test_acc": 0.5} if "test_loss" in d else {})}), max_size=8)


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
