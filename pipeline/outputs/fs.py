"""The output directory of a run: whose it is, what may be replaced, and reading back what a run wrote.

A directory is ours once it holds the marker file :data:`MARKER`, written when a run first
claims a new or empty directory. Only then are files in it replaced or pruned: a non-empty
directory without the marker is refused, whatever it holds (``config.json``, ``model.npz`` or
``checkpoints/round-*`` of some other program included), and ``--overwrite`` replaces only our
own runs. An overwrite first moves the old run's files aside into :data:`PREVIOUS` inside the
directory; the old run is deleted once the new one has written its first checkpoint
(:func:`commit`), and put back if the new one fails before that (:func:`restore`), also by the
next command when the process was killed (:func:`settle`).

Pure file-system code (no dask, no chainer). Adopting a run directory written before markers
existed: ``touch OUT/.dask-chainer-run``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from pipeline.core.errors import OutputError, ResumeError, UsageError, one_line
from pipeline.core.files import (MIB, check_size, open_append, open_regular, os_reason,
                                  read_text, size_of)

MARKER = ".dask-chainer-run"
PREVIOUS = ".previous-run"  # an overwritten run, kept until the new one has a checkpoint
# Always set aside by an overwrite besides the run's outputs (pipeline.outputs.run_dir names those).
ALWAYS_SET_ASIDE = ("config.json", "dashboard.log")
CHECKPOINT_RE = re.compile(r"round-(\d{6})")  # the only directory names pruned or resumed
MAX_METRICS_LINE = 1 * MIB  # a metrics line is ~400 bytes; a longer one is not ours
MAX_CONFIG_BYTES = 1 * MIB  # config.json and summary.json are ~2 KB


def is_ours(out: Path) -> bool:
    """Whether ``out`` carries our marker (a regular file, not a link to one elsewhere)."""
    with contextlib.suppress(OSError):
        return (Path(out) / MARKER).lstat().st_mode & 0o170000 == 0o100000
    return False


def check(out: Path, resume: bool, overwrite: bool) -> None:
    """Whether a run may write into ``out`` at all: a new or empty directory, or one marked
    ours; UsageError with one line if not. Changes nothing. (Whether the run in a directory of
    ours may be replaced is ``pipeline.outputs.run_dir.prepare``'s question.)"""
    out = Path(out)
    if str(out) == "":
        raise UsageError("the output directory must not be empty ('')")
    if out.exists() and not out.is_dir():
        raise UsageError(f"output directory {out} exists and is not a directory")
    if resume:
        if not is_ours(out):
            raise ResumeError(f"cannot resume {out}: it has no {MARKER} marker, so it is not a "
                              f"run directory of ours (a run written before markers existed: "
                              f"`touch {out / MARKER}`)")
        return
    if not out.is_dir():
        return
    if not is_ours(out):
        if any(True for _ in out.iterdir()):
            raise UsageError(f"{out} is not empty and holds no run of ours (no {MARKER} "
                             "marker): pick a new or empty --out; nothing in it was changed")
        return


def claim(out: Path) -> None:
    """Create ``out`` if needed and mark it ours (after :func:`check`)."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not is_ours(out):
            (out / MARKER).write_text("a run directory of dask-chainer-pipeline: its runs may "
                                      "replace and prune the files they wrote here\n")
    except OSError as exc:
        raise OutputError(f"cannot create output directory {out}: {os_reason(exc)}") from None


def set_aside(out: Path, names: tuple = ()) -> list[str]:
    """``--overwrite``: move the old run's files (``names`` and ``ALWAYS_SET_ASIDE``) into
    ``out/.previous-run``; returns the names moved.

    The old run stays whole until :func:`commit` (the new run has a checkpoint) or comes back
    with :func:`restore`.
    """
    out = Path(out)
    present = [name for name in dict.fromkeys(ALWAYS_SET_ASIDE + tuple(names))
               if (out / name).exists() or (out / name).is_symlink()]
    if not present:
        return []
    previous = out / PREVIOUS
    try:
        previous.mkdir(exist_ok=False)
        for name in present:
            os.replace(out / name, previous / name)
    except OSError as exc:
        restore(out)
        raise OutputError(f"cannot set the old run in {out} aside for --overwrite "
                          f"({os_reason(exc)}); nothing was replaced") from None
    return present


def commit(out: Path) -> None:
    """The new run has something to replace the old one with: delete the set-aside old run."""
    previous = Path(out) / PREVIOUS
    if previous.exists():
        shutil.rmtree(previous, ignore_errors=True)


def restore(out: Path) -> bool:
    """Put a set-aside run back, removing the files of the run that replaced it (an overwrite
    that failed before its first checkpoint). Returns whether there was one."""
    out = Path(out)
    previous = out / PREVIOUS
    if not previous.is_dir() or previous.is_symlink():
        return False
    for entry in previous.iterdir():  # what set_aside moved: the new run's files make way
        _remove(out / entry.name)
        os.replace(entry, out / entry.name)
    shutil.rmtree(previous, ignore_errors=True)
    return True


def settle(out: Path, log: Callable[[str], None] | None = None) -> None:
    """Finish an overwrite that a killed process left half done: keep the new run if it got a
    checkpoint, else put the old one back."""
    out = Path(out)
    if not (out / PREVIOUS).is_dir():
        return
    if has_checkpoint(out):
        commit(out)
    elif restore(out) and log:
        log(f"restored the run in {out} that an interrupted --overwrite had set aside")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Checkpoint directories


def has_checkpoint(out: Path) -> bool:
    """Whether ``out/checkpoints`` holds a checkpoint directory of ours (:func:`checkpoint_dirs`:
    ``round-NNNNNN``, not a link). Whether it is readable is the loader's question: a damaged
    one is reported on resume, never taken for no checkpoint. ``checkpoint.save`` renames a
    whole directory into place, so a run's own checkpoint is complete once it is there."""
    return bool(checkpoint_dirs(Path(out) / "checkpoints"))


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(round, path)`` of the ``round-NNNNNN`` directories under ``root``, oldest first; any
    other name is not ours and is neither read nor pruned."""
    found = []
    with contextlib.suppress(OSError):
        for path in Path(root).iterdir():
            match = CHECKPOINT_RE.fullmatch(path.name)
            if match and path.is_dir() and not path.is_symlink():
                found.append((int(match.group(1)), path))
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# JSON outputs


def finite_or_none(value):
    """``value`` with every non-finite float replaced by None (JSON has no NaN or Infinity).

    >>> finite_or_none({"loss": float("nan"), "acc": [0.5, float("inf")]})
    {'loss': None, 'acc': [0.5, None]}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """``json.dumps`` that writes valid JSON only: NaN and infinities become null.

    >>> dumps({"test_loss": float("inf")})
    '{"test_loss": null}'
    """
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)


def append_lines(path: Path, lines: list[dict]) -> None:
    """Append JSON lines (one write per whole line); OutputError if it cannot."""
    try:  # never through a symbolic link: the lines go into this directory or nowhere
        with open_append(path, OutputError) as f:
            for line in lines:
                f.write(dumps(line) + "\n")
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {os_reason(exc)}") from None


LINE_BUDGET = 64 * 1024  # bytes a JSON-lines file may hold per record (ours are ~150-400 bytes)


def lines_limit(records: int) -> int:
    """The most bytes a JSON-lines file of ``records`` records of ours may hold.

    >>> lines_limit(10)
    1703936
    """
    return MIB + LINE_BUDGET * max(0, records)


def read_lines(path: Path, keep: Callable[[dict], bool] = lambda record: True,
               log: Callable[[str], None] | None = None, records: int = 1 << 20) -> list[dict]:
    """The records of a JSON-lines file of ours (``metrics.jsonl``, ``updates.jsonl``) for which
    ``keep(record)`` holds, in file order.

    A line that is not a whole JSON object (garbage, a torn write), or that ``keep`` cannot judge
    (a field missing or of the wrong type), is skipped and the others are kept: one bad line never
    drops the lines after it. ``log`` hears one line naming the skipped ones. ``records``: how
    many the run can have written; a file larger than :func:`lines_limit` of it (60 M empty
    lines, a sparse terabyte) is refused before a line is read.
    """
    kept, bad, limit = [], [], lines_limit(records)
    what = f"a run's log of {records} records"
    with open_regular(path, ResumeError) as f:
        check_size(path, size_of(f), limit, what, ResumeError)
        read = 0
        for number, raw in enumerate(iter(lambda: f.readline(MAX_METRICS_LINE + 1), b""), 1):
            read += len(raw)
            check_size(path, read, limit, what, ResumeError)  # it grew meanwhile
            record = _json_record(raw)
            try:
                if record is None:
                    bad.append(number)
                elif keep(record):
                    kept.append(record)
            except (KeyError, TypeError, ValueError):
                bad.append(number)
    if bad and log:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        log(f"{path}: skipped {len(bad)} unreadable line(s) (line {shown})")
    return kept


def read_metrics(path: Path, last_round: int, log: Callable[[str], None] | None = None,
                 rounds: int = 1 << 20) -> list[dict]:
    """The lines of ``metrics.jsonl`` for rounds ``0..last_round``, one per round, in round order
    (a line naming a round again, or no round, is skipped like a garbled one). ``rounds``: the
    run's planned rounds (what bounds the file)."""
    seen: set = set()

    def keep(record):
        r = record["round"]
        if type(r) is not int or r < 0 or r in seen:
            raise ValueError(r)
        seen.add(r)
        return r <= last_round
    return sorted(read_lines(path, keep, log, rounds), key=lambda record: record["round"])


def _json_record(raw: bytes) -> dict | None:
    if not raw.endswith(b"\n") or len(raw) > MAX_METRICS_LINE:
        return None  # torn (the writer was killed mid-line), or not a line of ours
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


# ---------------------------------------------------------------------------------------------
# Reading a run's JSON files back


def read_json(path: Path, error: type[Exception] = UsageError, limit: int = MAX_CONFIG_BYTES):
    """A run's JSON file as input like any other: a regular file, capped, parsed (``error`` with
    one line naming the path otherwise)."""
    text = read_text(path, limit, f"a run's {Path(path).name}", error)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise error(f"{path} is unreadable ({one_line(exc, kind=False, limit=120)})") from None


def read_config(out: Path, error: type[Exception] = UsageError, cluster: bool = True):
    """The Config a run directory was written with, every field checked for type and range.

    ``cluster=False`` drops the cluster section (scheduler, dashboard bind, TLS files): where and
    how a resumed run runs comes from the command line, never from the directory.
    """
    from pipeline.core.config import Config
    path = Path(out) / "config.json"
    if not path.exists() and not path.is_symlink():
        raise error(f"{out} is not a run directory: it has no config.json")
    saved = read_json(path, error)
    if isinstance(saved, dict) and not cluster:
        saved.pop("cluster", None)
    try:
        return Config.from_dict(saved)
    except (ValueError, TypeError) as exc:
        raise error(f"{path}: {one_line(exc, kind=False, limit=160)}") from None
