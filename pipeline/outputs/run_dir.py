"""A run's output directory: metrics.jsonl, model.npz, curves.png, config.json, summary.json,
checkpoints; checked before a run starts, created once it is under way, checked again on resume.

Whose the directory is and what may be replaced (the marker, an overwrite set aside until the new
run has a checkpoint) are ``pipeline.outputs.fs``'s file-system rules; this module applies them.
"""
from __future__ import annotations

import os
from pathlib import Path

from pipeline.core import files
from pipeline.outputs import checkpoint
from pipeline.outputs import resume as resuming
from pipeline.outputs import fs
from pipeline.core.state import HostState
from pipeline.core.errors import UsageError
from pipeline.data.kept import EVAL_FILE
from pipeline.outputs.mlflow_tracking import RECORD as MLFLOW_RECORD

# Files of a finished or interrupted run that --overwrite removes (strategies may add their own).
RUN_FILES = ("metrics.jsonl", "metrics.csv", "model.npz", "curves.png", "summary.json",
             "data.json", EVAL_FILE, MLFLOW_RECORD)
RUN_DIRS = ("checkpoints", "tensorboard")


def prepare(out: str | None, resume: bool, overwrite: bool) -> Path | None:
    """Check the output directory without creating it: a run refused later (bad data, no
    worker, unreachable scheduler) must leave nothing behind. ``RunDir.create`` makes it."""
    if out is None:
        if resume:
            raise UsageError("resume needs an output directory (--out)")
        return None
    out = Path(out)
    if out.is_dir() and fs.is_ours(out):
        fs.settle(out)  # first: an overwrite that a killed process left half done
    fs.check(out, resume, overwrite)  # a new or empty directory, or one marked ours
    if out.is_dir():  # what a run writes stays in OUT: a link among its names is refused
        for name in files.links_in(out, RUN_FILES + RUN_DIRS + ("dashboard.log",)):
            files.refuse_link(out / name, UsageError)
    if not resume and out.is_dir() and (out / "metrics.jsonl").exists() and not overwrite:
        if not fs.has_checkpoint(out) and not resuming.finished(out):
            raise UsageError(f"{out} holds a run that stopped before its first checkpoint: start "
                             f"it again with --resume {out}, or replace it with --overwrite")
        raise UsageError(f"{out} already holds a run; resume it with --resume {out} (add --epochs "
                         "N to train it longer) or pick another --out")
    parent = out.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot create output directory {out}: {parent} is not a writable "
                         "directory")
    return out


class RunDir:
    """The output directory of one run (``path`` None: a run that writes nothing)."""

    def __init__(self, path: Path | None, config, log=None, extra_files: tuple = (),
                 data: dict | None = None, kept: dict | None = None):
        self.path, self.config = path, config
        self.data = data  # data.json: the data's kind, class names and splits
        self.kept = kept  # the evaluation split of data no source finds again (EVAL_FILE)
        self.log = log or (lambda message: None)
        self.extra_files = tuple(extra_files)

    def __bool__(self) -> bool:
        return self.path is not None

    def create(self, resume: bool, overwrite: bool) -> None:
        """Create the directory once the run is under way; clear a replaced run's outputs;
        write config.json; after a resume, drop metrics past the checkpoint and temporaries."""
        if self.path is None:
            return
        fs.claim(self.path)  # created and marked ours
        if not resume and overwrite:  # set aside until the new run's first checkpoint
            fs.set_aside(self.path, RUN_FILES + RUN_DIRS + self.extra_files)
        checkpoint.write_atomic(self.path / "config.json", self.config.to_json())
        if self.data is not None:
            checkpoint.write_atomic(self.path / "data.json", fs.dumps(self.data, indent=1))
        if self.kept is not None and not (resume and (self.path / EVAL_FILE).is_file()):
            from pipeline.core import npz
            checkpoint.write_atomic(self.path / EVAL_FILE, npz.to_bytes(self.kept))
        if resume:
            for name in checkpoint.remove_temporaries(self.path):  # a killed driver's half-writes
                self.log(f"removed {name}, left by an interrupted write")

    def append(self, name: str, lines: list[dict]) -> None:
        """Append JSON lines to ``name`` (one write per whole line)."""
        if self.path is None or not lines:
            return
        fs.append_lines(self.path / name, lines)

    def truncate(self, name: str, keep, records: int = 1 << 20) -> list[dict]:
        """Keep the lines of ``name`` for which ``keep(line)`` holds, up to a torn last line;
        rewrite the file atomically. Returns the kept lines. ``records``: how many lines the
        run can have written (bounds the read: ``fs.lines_limit``)."""
        path = self.path / name
        if not path.exists():
            return []
        kept = fs.read_lines(path, keep, self.log, records)  # a garbled line is skipped
        checkpoint.write_atomic(path, "".join(fs.dumps(x) + "\n" for x in kept))
        return kept

    def save_checkpoint(self, state: HostState, model_params: dict) -> None:
        checkpoint.save(self.path, state, model_params, resuming.recorded(self.config))
        fs.commit(self.path)  # the new run has a checkpoint: an overwritten run may go

    def has_checkpoint(self) -> bool:
        """Whether a resume has a checkpoint to read (``fs.has_checkpoint``)."""
        return self.path is not None and fs.has_checkpoint(self.path)


    def finish(self, params: dict, history: list[dict], rounds: int, labels: dict) -> None:
        """model.npz (the final state dict, in the layout Chainer's ``save_npz`` writes),
        curves.png and summary.json of a finished run."""
        if self.path is None:
            return
        from pipeline.core import npz
        from pipeline.outputs.plots import save_curves
        # what chainer's save_npz writes (compressed), in one atomic write (OutputError if full)
        checkpoint.write_atomic(self.path / "model.npz",
                                npz.to_bytes(params, compress=True))
        save_curves(history, self.path / "curves.png", **labels)
        last = history[-1] if history else {}
        summary = dict(status="done", rounds=rounds, epochs=self.config.train.epochs,
                       seconds=last.get("seconds"), train_acc=last.get("train_acc"),
                       test_acc=last.get("test_acc"), test_loss=last.get("test_loss"),
                       model=self.config.model.name, n_classes=labels.get("n_classes"),
                       dataset=labels.get("dataset"), dataset_kind=self.config.data.dataset,
                       eval_split=(self.data or {}).get("splits", {}).get("eval", "test"),
                       class_names=(self.data or {}).get("class_names"))
        checkpoint.write_atomic(self.path / "summary.json", fs.dumps(summary, indent=1))
