"""Training metrics in a notebook: one metrics line per round and a live plot redrawn in place."""
from __future__ import annotations

import io
import sys
from collections.abc import Callable, Sequence

from matplotlib.figure import Figure

OnRound = Callable[[dict], None]


# ---------------------------------------------------------------------------------------------
# Pure helpers


def format_line(line: dict) -> str:
    """One round as one line of text (test metrics only when the round was evaluated).

    >>> format_line({"round": 3, "epoch_float": 1.0, "train_loss": 2.2, "train_acc": 0.14,
    ...              "test_loss": 2.25, "test_acc": 0.129, "seconds": 11.7})
    'round 3 epoch 1.00: train loss 2.200 acc 0.140 | test loss 2.250 acc 0.129 | 11.7 s'
    >>> format_line({"round": 0, "epoch_float": 0.25, "train_loss": 2.3, "train_acc": 0.1})
    'round 0 epoch 0.25: train loss 2.300 acc 0.100'
    """
    text = (f"round {line['round']} epoch {line['epoch_float']:.2f}: "
            f"train loss {line['train_loss']:.3f} acc {line['train_acc']:.3f}")
    if "test_acc" in line:
        text += f" | test loss {line['test_loss']:.3f} acc {line['test_acc']:.3f}"
    if "seconds" in line:
        text += f" | {line['seconds']:.1f} s"
    return text


def split_series(history: Sequence[dict]) -> tuple[dict, dict]:
    """Rounds -> (train, test) column dicts keyed epoch/loss/acc (lists of floats); test holds
    only the evaluated rounds.

    >>> train, test = split_series([
    ...     {"epoch_float": 0.5, "train_loss": 2.3, "train_acc": 0.1},
    ...     {"epoch_float": 1.0, "train_loss": 2.1, "train_acc": 0.2, "test_loss": 2.0,
    ...      "test_acc": 0.25}])
    >>> train["epoch"], train["acc"], test["epoch"], test["loss"]
    ([0.5, 1.0], [0.1, 0.2], [1.0], [2.0])
    """
    tested = [h for h in history if "test_acc" in h]
    train = {"epoch": [float(h["epoch_float"]) for h in history],
             "loss": [float(h["train_loss"]) for h in history],
             "acc": [float(h["train_acc"]) for h in history]}
    test = {"epoch": [float(h["epoch_float"]) for h in tested],
            "loss": [float(h["test_loss"]) for h in tested],
            "acc": [float(h["test_acc"]) for h in tested]}
    return train, test


def live_figure(history: Sequence[dict], title: str = "") -> Figure:
    """Two panels against epoch: loss (train line, test markers) and accuracy (same).

    The title says the latest round. Built on ``matplotlib.figure.Figure`` (no pyplot state).

    >>> fig = live_figure([{"round": 0, "epoch_float": 0.5, "train_loss": 2.3, "train_acc": 0.1}])
    >>> [ax.get_ylabel() for ax in fig.axes]
    ['loss', 'accuracy']
    """
    fig = Figure(figsize=(9, 3.2), layout="constrained")
    loss_ax, acc_ax = fig.subplots(1, 2)
    train, test = split_series(history)
    for ax, name, label in ((loss_ax, "loss", "loss"), (acc_ax, "acc", "accuracy")):
        ax.plot(train["epoch"], train[name], ".-", label="train", alpha=0.8)
        ax.plot(test["epoch"], test[name], "o-", label="test")
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    acc_ax.set_ylim(0, 1)
    acc_ax.legend(loc="upper left")
    latest = format_line(history[-1]) if history else "waiting for the first round"
    fig.suptitle(f"{title}: {latest}" if title else latest, fontsize=9)
    return fig


def compose(*callbacks: OnRound | None) -> OnRound:
    """One ``on_round`` that calls each callback in turn (None entries skipped), e.g.
    ``compose(LivePlot(), dashboard.dashboard_events(client))``.

    >>> seen = []
    >>> compose(seen.append, None, lambda line: seen.append(line["round"]))({"round": 1})
    >>> seen
    [{'round': 1}, 1]
    """
    chosen = [c for c in callbacks if c is not None]

    def on_round(line: dict) -> None:
        for callback in chosen:
            callback(line)
    return on_round


def in_notebook() -> bool:
    """Whether this code runs in a Jupyter kernel (which can show and update rich outputs).

    >>> in_notebook()
    False
    """
    ipython = sys.modules.get("IPython")
    if ipython is None:  # never imported: certainly not a kernel
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


# ---------------------------------------------------------------------------------------------
# Notebook


class LivePlot:
    """``on_round`` callback: loss and accuracy per round, redrawn in place in a notebook.

    In a Jupyter kernel the first round creates one PNG output and later rounds replace it
    (``display(..., display_id=True)`` then ``handle.update``), so the cell shows a single,
    current figure. Elsewhere, or with ``display=False``, each round prints :func:`format_line`
    to ``file`` (default stdout). ``history`` keeps every line received.
    """

    def __init__(self, title: str = "", *, display: bool | None = None, file=None, dpi: int = 80):
        self.title, self.dpi, self.file = title, dpi, file
        self.display = in_notebook() if display is None else display
        self.history: list[dict] = []
        self._handle = None

    def __call__(self, line: dict) -> None:
        self.history.append(line)
        if self.display:
            self._redraw()
        else:
            print(format_line(line), file=self.file or sys.stdout, flush=True)

    def figure(self) -> Figure:
        """The current figure (:func:`live_figure` of ``history``)."""
        return live_figure(self.history, self.title)

    def _redraw(self) -> None:
        from IPython.display import Image, display
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png", dpi=self.dpi)  # ~0.1 s at 80 dpi
        image = Image(data=buf.getvalue(), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)


# Dashboard names importable from here for one release (they live in outputs.dashboard).
_IN_DASHBOARD = ("TOPIC", "ACTION", "PAGE", "event_of", "progress_of", "clean_event",
                 "status_html", "DASHBOARD_LOGGERS", "dashboard_log", "DashboardEvents",
                 "dashboard_events", "training_events", "add_dashboard_page", "install_page",
                 "TrainingPage")


def __getattr__(name: str):
    if name in _IN_DASHBOARD:
        import importlib
        import warnings
        warnings.warn(f"pipeline.outputs.live.{name} moved to pipeline.outputs.dashboard.{name}; "
                      "the old name goes in the next release", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("pipeline.outputs.dashboard"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
