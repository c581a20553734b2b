"""Extensions: what the driver runs once a round is collected, in Chainer's ``Extension`` shape.

An extension has a ``trigger(state)`` (whether it runs for this round), a ``priority`` (higher
runs first; Chainer's writer/editor/reader levels), ``initialize(info)`` once the run is set up,
``__call__(state)`` for a round, ``on_error(exc)`` when the run ends with an exception and
``finalize()`` however it ends. The built-ins write metrics.jsonl, run the per-line hooks of
:mod:`pipeline.outputs.hooks` and ``on_round``, draw the progress bar, save checkpoints, move the
anchor and save the curves of an interrupted run. All run on the driver, never in a task.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Callable, NamedTuple

from pipeline.core.errors import Interrupted
from pipeline.outputs.hooks import RunInfo

if TYPE_CHECKING:
    from pipeline.core.schedule import Round
    from pipeline.training.attempt import Attempt, Pending

# Chainer's levels (chainer.training.extension): writers add to what readers report.
PRIORITY_WRITER = 300
PRIORITY_EDITOR = 200
PRIORITY_READER = 100
PRIORITY_RECORDS = 0  # the strategy's own records, after every reader of the line
PRIORITY_SNAPSHOT = -100  # Chainer's snapshot priority: after everything that reads the round
PRIORITY_ANCHOR = -200  # the lineage is cut once the state is saved


class RoundState(NamedTuple):
    """What triggers and extensions see once a round is collected."""
    rnd: Round
    line: dict  # its metrics line (pipeline.outputs.metrics.line)
    new: bool  # first report (False: a round replayed after lost work, already written)
    anchor: bool  # the state after the round becomes the anchor (gathered and checked)
    stopping: bool  # a stop was requested: the run ends after this round
    attempt: Attempt  # the attempt that collected it
    pending: Pending  # its futures and the strategy's records


class Extension:
    """Base: runs for every newly reported round at reader priority; does nothing."""
    priority = PRIORITY_READER

    def trigger(self, state: RoundState) -> bool:
        return state.new

    def initialize(self, info: RunInfo) -> None:
        """Once the run is set up, before its first round."""

    def __call__(self, state: RoundState) -> None:
        """A round, when ``trigger(state)`` holds."""

    def on_error(self, exc: BaseException) -> None:
        """The run ends with ``exc`` (called before ``finalize``)."""

    def finalize(self) -> None:
        """The run ends, however it ends."""


def ordered(extensions: list) -> list:
    """Highest priority first; equal priorities keep the order given (as Chainer's do).

    >>> class A(Extension): priority = PRIORITY_WRITER
    >>> [type(e).__name__ for e in ordered([Extension(), A(), Extension()])]
    ['A', 'Extension', 'Extension']
    """
    return sorted(extensions, key=lambda ext: -ext.priority)


# ---- the round's line ------------------------------------------------------------------------
class MetricsLog(Extension):
    """``OUT/metrics.jsonl``: one line per round; the record the readers after it follow."""
    priority = PRIORITY_WRITER

    def __init__(self, out):
        self.out = out  # pipeline.outputs.run_dir.RunDir

    def __call__(self, state: RoundState) -> None:
        self.out.append("metrics.jsonl", [state.line])


class LineHook(Extension):
    """A per-line hook (:mod:`pipeline.outputs.hooks`: CSV, TensorBoard, the chance watch, the
    dashboard page): called with each new round's line, its ``start(info)`` and ``close()``,
    where it has them, at ``initialize`` and ``finalize``."""

    def __init__(self, hook: Callable[[dict], None]):
        self.hook = hook

    def initialize(self, info: RunInfo) -> None:
        getattr(self.hook, "start", lambda info: None)(info)

    def __call__(self, state: RoundState) -> None:
        self.hook(state.line)

    def finalize(self) -> None:
        getattr(self.hook, "close", lambda: None)()


class OnRound(Extension):
    """``train(on_round=f)``: ``f(line)`` for each new round (notebook plots, dashboards)."""

    def __init__(self, callback: Callable[[dict], None]):
        self.callback = callback

    def __call__(self, state: RoundState) -> None:
        self.callback(state.line)


def as_extension(hook) -> Extension:
    """An extension as it is; a per-line hook wrapped in ``LineHook``."""
    return hook if isinstance(hook, Extension) else LineHook(hook)


class ProgressBar(Extension):
    """A text bar of rounds on stderr with the newest loss and accuracy (``progress`` in the
    config turns it off)."""

    def __init__(self):
        self.bar = None
        self.split = "test"  # the evaluated split's name: image sources call theirs val

    def initialize(self, info: RunInfo) -> None:
        from tqdm.std import tqdm
        self.split = eval_split(info.config.data.dataset)  # text bar: tqdm.auto warns in kernels without ipywidgets
        self.bar = tqdm(total=len(info.rounds), initial=info.first_round, unit="round",
                        disable=not info.config.progress, file=sys.stderr, dynamic_ncols=True)

    def __call__(self, state: RoundState) -> None:
        line = state.line
        postfix = dict(loss=f"{line['train_loss']:.3f}", acc=f"{line['train_acc']:.3f}")
        if "test_acc" in line:
            postfix[f"{self.split}_acc"] = f"{line['test_acc']:.3f}"
        self.bar.set_postfix(postfix, refresh=False)  # before update, which draws: no lag
        self.bar.update(1)

    def finalize(self) -> None:
        if self.bar is not None:
            self.bar.close()


def eval_split(kind: str) -> str:
    """The name of the split a run evaluates on: ``val`` for image folders and file lists.

    >>> eval_split("cifar10"), eval_split("image-folder")
    ('test', 'val')
    """
    from pipeline.data.datasets import facts  # the reader's own fact
    return facts(kind).eval_split


# ---- the state after the round ---------------------------------------------------------------
class StrategyRecords(Extension):
    """The strategy logs what it keeps of every collected round (async: ``updates.jsonl``),
    replays included."""
    priority = PRIORITY_RECORDS

    def trigger(self, state: RoundState) -> bool:
        return True

    def __call__(self, state: RoundState) -> None:
        state.attempt.strategy.collected(state.rnd, state.pending.records)


class Checkpoint(Extension):
    """``OUT/checkpoints/``: the state after each checkpoint round (``schedule.checkpoints``) and
    after the last round before a requested stop."""
    priority = PRIORITY_SNAPSHOT

    def __init__(self, out, schedule):
        self.out, self.schedule = out, schedule  # RunDir, triggers.Schedule

    def trigger(self, state: RoundState) -> bool:
        return bool(self.out) and state.anchor and (
            state.stopping or self.schedule.checkpoints(state.rnd))

    def __call__(self, state: RoundState) -> None:
        host = state.attempt.state_after(state.pending)
        self.out.save_checkpoint(host, state.attempt.strategy.final_params(host))


class Anchor(Extension):
    """The state after an anchor round becomes the one a replay goes back to; the rounds after
    it start from it as fresh roots (not when the run stops there, nor after the ``schedule``'s
    last round: no round follows to read them)."""
    priority = PRIORITY_ANCHOR

    def __init__(self, schedule=None):
        self.schedule = schedule

    def trigger(self, state: RoundState) -> bool:
        return state.anchor

    def __call__(self, state: RoundState) -> None:
        attempt = state.attempt
        last = self.schedule is not None and self.schedule.last(state.rnd)
        attempt.move_anchor(attempt.state_after(state.pending),
                            reroot=not (state.stopping or last))


def curve_labels(info: RunInfo) -> dict:
    """Title, data and class count of the curves of a run."""
    cfg = info.config
    return dict(title=f"{cfg.train.strategy} K={cfg.train.replicas} {cfg.model.name}",
                dataset=info.dataset, n_classes=info.n_classes,
                split=eval_split(cfg.data.dataset))


class Curves(Extension):
    """``OUT/curves.png`` of a run stopped on request (a finished run's come with its model)."""

    def __init__(self):
        self.info: RunInfo | None = None

    def trigger(self, state: RoundState) -> bool:
        return False

    def initialize(self, info: RunInfo) -> None:
        self.info = info

    def on_error(self, exc: BaseException) -> None:
        if isinstance(exc, Interrupted) and self.info is not None and self.info.out is not None:
            from pipeline.outputs.plots import save_curves
            save_curves(self.info.history, self.info.out / "curves.png", **curve_labels(self.info))


# ---- results that leave the run directory ----------------------------------------------------
class MLflowLog(Extension):
    """The run on an MLflow tracking server (``--mlflow URI``;
    :mod:`pipeline.outputs.mlflow_tracking`): the config as parameters when the MLflow run is
    created (a resume goes on in the run ``OUT/mlflow.json`` names), each new round's metrics
    (TensorBoard's scalars: loss, accuracy, lr, seconds per stage; and the wall seconds) at its
    step, each step once (a resume's recomputed rounds are not logged again), then the run's files and its end status. Lost calls are one warning line at the end."""

    def __init__(self, uri: str):
        self.uri, self.tracker, self.info, self.status = uri, None, None, "FINISHED"
        self.logged = -1  # the last step the MLflow run has (a resume's rounds up to it are in)

    def initialize(self, info: RunInfo) -> None:
        from pipeline.outputs import mlflow_tracking as tracking
        out = info.out
        known = tracking.read_record(out, self.uri) if out is not None else None

        def started(run_id: str) -> None:  # now, or once a server that was down answers
            if out is not None and run_id != known:
                tracking.write_record(out, self.uri, run_id)
            if run_id == known:  # a resume recomputes the rounds after its checkpoint: the
                self.logged = self.tracker.last_step("loss/train")  # same bits, logged once
        self.info = info
        self.tracker = tracking.Tracker(self.uri, info.log, on_start=started)
        self.tracker.start(known, out.name if out is not None else None,
                           tracking.params_of(info.config.to_dict()))

    def __call__(self, state: RoundState) -> None:
        from pipeline.outputs.hooks import scalars
        line = state.line
        if line["step"] <= self.logged:
            return
        self.tracker.log_metrics(line["step"], {**scalars(line), "wall_seconds": line["seconds"]})

    def on_error(self, exc: BaseException) -> None:
        self.status = "KILLED" if isinstance(exc, (Interrupted, KeyboardInterrupt)) else "FAILED"

    def finalize(self) -> None:
        """After the run's files are written (the loop finalizes after ``RunDir.finish``): a
        finished run's ``ARTIFACTS``, a stopped one's config and curves, a failed one's config."""
        if self.tracker is None:
            return
        from pipeline.outputs.mlflow_tracking import ARTIFACTS
        names = {"FINISHED": ARTIFACTS, "KILLED": ("config.json", "curves.png"),
                 "FAILED": ("config.json",)}[self.status]
        out = self.info.out
        for name in names if out is not None else ():
            if (out / name).is_file():
                self.tracker.log_artifact(out / name)
        self.tracker.end(self.status)
        summary = self.tracker.summary()
        if summary:
            self.info.log(summary)


def standard(config, out, schedule, hooks=(), on_round=None) -> list[Extension]:
    """The extensions of a run, in the order they run: metrics.jsonl, the ``hooks`` given, those
    the config asks for, ``on_round``, the progress bar, the strategy's records, checkpoints,
    anchors, the curves of an interrupted run."""
    from pipeline.outputs import hooks as line_hooks
    chosen = [MetricsLog(out), *(as_extension(h) for h in hooks),
              LineHook(line_hooks.ChanceWatch())]
    if out and config.csv:
        chosen.append(LineHook(line_hooks.CSVLog(out.path / "metrics.csv")))
    if out and config.tensorboard:
        chosen.append(LineHook(line_hooks.TensorBoardLog(out.path / "tensorboard")))
    if config.mlflow:
        chosen.append(MLflowLog(config.mlflow))
    if on_round is not None:
        chosen.append(OnRound(on_round))
    chosen += [ProgressBar(), StrategyRecords(), Checkpoint(out, schedule), Anchor(schedule), Curves()]
    return ordered(chosen)
