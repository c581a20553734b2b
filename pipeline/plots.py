"""Training curves as seed 000 drew them: accuracy against epochs and against wall time."""
from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure


def curves_figure(history: list[dict], title: str = "") -> Figure:
    """Two panels: train/test accuracy vs epoch, and vs seconds since the start."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    by_epoch, by_time = fig.subplots(1, 2)
    epochs = [h["epoch_float"] for h in history]
    seconds = [h["seconds"] for h in history]
    train = [h["train_acc"] for h in history]
    tested = [h for h in history if "test_acc" in h]
    for ax, x, xt in ((by_epoch, epochs, [h["epoch_float"] for h in tested]),
                      (by_time, seconds, [h["seconds"] for h in tested])):
        ax.plot(x, train, label="train", alpha=0.7)
        ax.plot(xt, [h["test_acc"] for h in tested], "o-", label="test")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    by_epoch.set_xlabel("epoch")
    by_time.set_xlabel("wall time (s)")
    if title:
        fig.suptitle(title)
    return fig


def save_curves(history: list[dict], path: str | Path, title: str = "") -> Path:
    """Write the figure under a temporary name and rename it: a reader never sees half a PNG."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    curves_figure(history, title).savefig(tmp, dpi=100)
    tmp.replace(path)
    return path
