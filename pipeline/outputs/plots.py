"""Training curves of a finished run: loss and accuracy against epochs, accuracy against wall time."""
from __future__ import annotations

import io
import math
from pathlib import Path

from matplotlib.figure import Figure


def curves_figure(history: list[dict], title: str = "", dataset: str | None = None,
                  n_classes: int | None = None, split: str = "test") -> Figure:
    """Three panels: train/test loss vs epoch, train/test accuracy vs epoch, and accuracy vs
    seconds of training. With ``n_classes`` a dashed line marks chance level (loss ln C,
    accuracy 1/C); ``dataset`` goes into the title; ``split`` names the evaluated split (image
    sources: val).

    >>> fig = curves_figure([{"epoch_float": 1.0, "seconds": 2.0, "train_loss": 2.3,
    ...                       "train_acc": 0.1}], "ipm", dataset="synthetic", n_classes=10)
    >>> [ax.get_ylabel() for ax in fig.axes], fig.get_suptitle()
    (['loss', 'accuracy', 'accuracy'], 'ipm on synthetic')
    """
    fig = Figure(figsize=(13, 4), layout="constrained")
    loss_ax, acc_ax, time_ax = fig.subplots(1, 3)
    tested = [h for h in history if "test_acc" in h]
    epochs = [h["epoch_float"] for h in history]
    test_epochs = [h["epoch_float"] for h in tested]
    loss_ax.plot(epochs, [h["train_loss"] for h in history], label="train", alpha=0.7)
    loss_ax.plot(test_epochs, [h["test_loss"] for h in tested], "o-", label=split)
    loss_ax.set_ylabel("loss")
    for ax, x, xt in ((acc_ax, epochs, test_epochs),
                      (time_ax, [h["seconds"] for h in history], [h["seconds"] for h in tested])):
        ax.plot(x, [h["train_acc"] for h in history], label="train", alpha=0.7)
        ax.plot(xt, [h["test_acc"] for h in tested], "o-", label=split)
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)
    if n_classes:
        loss_ax.axhline(math.log(n_classes), color="grey", ls="--", lw=1,
                        label=f"chance (ln {n_classes})")
        for ax in (acc_ax, time_ax):
            ax.axhline(1 / n_classes, color="grey", ls="--", lw=1, label=f"chance (1/{n_classes})")
    for ax in (loss_ax, acc_ax, time_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    loss_ax.set_xlabel("epoch")
    acc_ax.set_xlabel("epoch")
    time_ax.set_xlabel("training time (s)")
    label = " on ".join(x for x in (title, dataset) if x)
    if label:
        fig.suptitle(label)
    return fig


def save_curves(history: list[dict], path: str | Path, title: str = "",
                dataset: str | None = None, n_classes: int | None = None,
                split: str = "test") -> Path:
    """Write the figure under a temporary name and rename it: a reader never sees half a PNG
    (``checkpoint.write_atomic``: OutputError naming the path, no temporary left, on a full
    disk)."""
    from pipeline.outputs.checkpoint import write_atomic
    path = Path(path)
    buf = io.BytesIO()
    curves_figure(history, title, dataset, n_classes, split).savefig(buf, format="png", dpi=100)
    write_atomic(path, buf.getvalue())
    return path
