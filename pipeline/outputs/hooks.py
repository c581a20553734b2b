"""Run-output hooks: small objects the driver calls with each round's metrics line, beside
metrics.jsonl: a CSV table, TensorBoard event files, and a watch for a run stuck at chance level.

A hook is callable with the metrics dict of a round (the lines of ``metrics.jsonl``) and may have
``start(info)`` (called once the run is set up, with a :class:`RunInfo`) and ``close()`` (called
when the run ends, however it ends). The driver runs each as an extension
(``pipeline.training.extensions.LineHook``), on the driver, never in a task. Column and stage
names are ``pipeline.outputs.metrics``'.
"""
from __future__ import annotations

import contextlib
import csv
import io
import math
from pathlib import Path
from typing import Callable, NamedTuple

from pipeline.core import files
from pipeline.core.errors import OutputError
from pipeline.outputs import checkpoint, metrics


class RunInfo(NamedTuple):
    """What a hook may want to know about the run it watches."""
    client: object  # the distributed.Client the run uses
    config: object  # pipeline.core.config.Config
    out: Path | None  # the output directory, or None
    rounds: list  # pipeline.core.schedule.Round for every round of the run
    per_epoch: int  # steps per epoch
    n_classes: int
    dataset: str  # a short name of the data, for titles
    history: list  # the metrics lines already written (a resumed run's earlier rounds)
    log: Callable[[str], None]
    first_round: int = 0  # the first round this run trains (after a resumed checkpoint's)


# ---------------------------------------------------------------------------------------------
# CSV


def csv_row(line: dict) -> list:
    """A metrics line as a CSV row: the scalar columns, then seconds per stage ('' when absent).

    >>> csv_row({"round": 0, "train_loss": 2.3, "stage_seconds": {"train": 1.5}})[:6]
    [0, '', '', '', 2.3, '']
    >>> len(csv_row({})) == len(csv_header())
    True
    """
    stages = line.get("stage_seconds") or {}
    return [line.get(c, "") for c in metrics.COLUMNS] + [stages.get(s, "") for s in metrics.STAGES]


def csv_header() -> list[str]:
    return list(metrics.COLUMNS) + [f"{s}_seconds" for s in metrics.STAGES]


class CSVLog:
    """``OUT/metrics.csv``: one row per round, the columns of :func:`csv_header`.

    Written whole at the start (a resumed run's kept rounds), then one appended row per round,
    so it always matches ``metrics.jsonl``.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def start(self, info: RunInfo) -> None:
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(csv_header())
        writer.writerows(csv_row(line) for line in info.history)
        checkpoint.write_atomic(self.path, text.getvalue())

    def __call__(self, line: dict) -> None:
        try:
            with files.open_append(self.path, OutputError) as f:  # never through a link
                csv.writer(f, lineterminator="\n").writerow(csv_row(line))
        except OSError as exc:
            raise OutputError(f"cannot write {self.path}: {files.os_reason(exc)}") from None


# ---------------------------------------------------------------------------------------------
# TensorBoard


def scalars(line: dict) -> dict[str, float]:
    """The TensorBoard scalars of a round: loss and accuracy (train, and test when evaluated),
    learning rate, images per second and seconds per stage.

    >>> sorted(scalars({"train_loss": 2.0, "train_acc": 0.2, "lr": 0.1, "images": 64,
    ...                 "stage_seconds": {"train": 0.5, "waiting": 0.1}}))
    ['accuracy/train', 'loss/train', 'lr', 'seconds/train', 'seconds/waiting']
    """
    out = {}
    for kind in ("train", "test"):
        if f"{kind}_loss" in line:
            out[f"loss/{kind}"] = float(line[f"{kind}_loss"])
            out[f"accuracy/{kind}"] = float(line[f"{kind}_acc"])
    if "lr" in line:
        out["lr"] = float(line["lr"])
    for stage, seconds in (line.get("stage_seconds") or {}).items():
        out[f"seconds/{stage}"] = float(seconds)
    return out


class TensorBoardLog:
    """TensorBoard event files in ``OUT/tensorboard/`` (``tensorboard --logdir OUT/tensorboard``).

    Written with tensorboardX (no TensorFlow, no PyTorch). The x axis is the global step (local
    optimizer steps per replica). A resumed run writes a new event file that starts with a purge
    at its first step, so TensorBoard drops the rounds the resume recomputes.
    """

    def __init__(self, logdir: str | Path):
        self.logdir = Path(logdir)
        self.writer = None
        self.failed: OSError | None = None  # what stopped tensorboardX's writer thread

    def start(self, info: RunInfo) -> None:
        from tensorboardX import SummaryWriter
        files.own_dir(self.logdir, OutputError)  # a link to elsewhere is refused, not followed
        purge = info.history[-1]["step"] + 1 if info.history else None
        try:
            self.writer = SummaryWriter(str(self.logdir), purge_step=purge, flush_secs=5)
        except OSError as exc:  # it writes the file's first event at once
            raise OutputError(f"cannot write {self.logdir}: {files.os_reason(exc)}") from None
        self._watch_writes()
        self._add(lambda: self.writer.add_text("config", "```\n" + info.config.to_json()
                                               + "\n```", global_step=purge or 0))

    def __call__(self, line: dict) -> None:
        for tag, value in scalars(line).items():
            self._add(lambda: self.writer.add_scalar(tag, value, global_step=line["step"]))

    def _add(self, add: Callable[[], None]) -> None:
        """One event, each only while the writer thread lives: tensorboardX hands events to its
        thread through a queue of 10, and a thread that died (a full disk) leaves ``put``
        waiting forever. One event per check: a thread that dies after a check has taken an
        event from the queue, so that one put still finds room."""
        worker = _writer_thread(self.writer)
        if self.failed is not None or (worker is not None and not worker.is_alive()):
            reason = files.os_reason(self.failed) if self.failed else "its writer thread stopped"
            raise OutputError(f"cannot write {self.logdir}: {reason}")
        add()

    def _watch_writes(self) -> None:
        """tensorboardX's writer thread dies on an OSError, with a traceback on the terminal
        and the queue left to fill; a failed write is kept here instead (the next event raises
        OutputError) and the thread lives on, dropping what it is given."""
        events = _events_writer(self.writer)
        if events is None:
            return

        def guarded(method):
            def call(*args):
                if self.failed is None:
                    try:
                        return method(*args)
                    except OSError as exc:
                        self.failed = exc
            return call
        events.write_event, events.flush = guarded(events.write_event), guarded(events.flush)

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is None:
            return
        worker = _writer_thread(writer)
        if worker is not None and not worker.is_alive():  # it would never take close()'s event
            _event_file_writer(writer)._closed = True  # nor the one of tensorboardX's atexit
            return
        try:
            writer.close()
        except (OSError, ValueError) as exc:
            if self.failed is None:
                raise OutputError(f"cannot write {self.logdir}: {files.os_reason(exc)}") from None


def _event_file_writer(writer):
    file_writer = getattr(writer, "file_writer", None)
    return getattr(file_writer, "event_writer", None)


def _writer_thread(writer):
    """tensorboardX's writer thread of ``writer`` (None if its internals moved)."""
    return getattr(_event_file_writer(writer), "_worker", None)


def _events_writer(writer):
    """The object that writes ``writer``'s event file (None if tensorboardX's internals moved)."""
    return getattr(_event_file_writer(writer), "_ev_writer", None)


# ---------------------------------------------------------------------------------------------
# A run that does not learn


def at_chance(lines: list[dict], n_classes: int) -> bool:
    """Whether every round of ``lines`` has its loss at chance level (within 0.03 of ln C, or
    above) and its accuracy near 1/C (below 1.5/C): the model predicts nothing.

    >>> at_chance([{"train_loss": 2.56, "train_acc": 0.10}, {"train_loss": 2.304,
    ...            "train_acc": 0.09}], 10)
    True
    >>> at_chance([{"train_loss": 2.5, "train_acc": 0.10}, {"train_loss": 2.21,
    ...            "train_acc": 0.17}], 10)
    False
    """
    chance = math.log(n_classes)
    return bool(lines) and all(line["train_loss"] >= chance - 0.03
                               and line["train_acc"] < 1.5 / n_classes for line in lines)


class ChanceWatch:
    """Logs one warning when a whole epoch of training stays at chance level (:func:`at_chance`),
    naming the likely cause: a learning rate too high for the model (its ReLUs die, or with
    leaky units it diverges; measured in docs/benchmarks.md), and what to try.

    The run's first round is left out (a fresh model starts at or above chance), and an epoch
    counts only with at least ``MIN_STEPS`` steps and two rounds besides that one: a few steps
    at chance are a start, not a verdict.
    """

    MIN_STEPS = 20

    def __init__(self) -> None:
        self.info: RunInfo | None = None
        self.epoch_lines: dict[int, list] = {}
        self.warned = False

    def start(self, info: RunInfo) -> None:
        self.info = info
        for line in info.history:
            self.epoch_lines.setdefault(line["epoch"], []).append(line)

    def __call__(self, line: dict) -> None:
        if self.info is None or self.warned:
            return
        lines = self.epoch_lines.setdefault(line["epoch"], [])
        lines.append(line)
        steps = sum(self.info.rounds[x["round"]].steps for x in lines)
        judged = [x for x in lines if x["round"] > 0]
        if (steps == self.info.per_epoch >= self.MIN_STEPS and len(judged) >= 2
                and at_chance(judged, self.info.n_classes)):
            self.warned = True
            self.info.log(self.message(line["epoch"]))

    def message(self, epoch: int) -> str:
        t, model = self.info.config.train, self.info.config.model.name
        c = self.info.n_classes
        step = f"lr {t.lr:g}"
        if t.optimizer == "momentum":
            step += (f" with momentum {t.momentum:g}, a step of {t.lr / (1 - t.momentum):g} per "
                     "unit gradient")
        return (f"warning: epoch {epoch} ended with the training loss at chance level (ln {c} = "
                f"{math.log(c):.3f}) and accuracy near 1/{c}: the model is not learning. Likely "
                f"cause: the learning rate ({step}) is too high for {model}; "
                f"try --lr {t.lr / 5:g} or --warmup-epochs 1")
