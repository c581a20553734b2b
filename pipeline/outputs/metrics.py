"""A round's metrics line (one line of ``metrics.jsonl``): its column names and the pure function
that builds it from the round's results.

Every writer of rounds (metrics.csv, TensorBoard, the live plot and dashboard events) takes the
names from here, so a new column is one edit.
"""
from __future__ import annotations

from pipeline.core import keys

# The scalar columns of a line, in the order of metrics.csv. test_loss and test_acc are present
# only in evaluated rounds; a strategy may add its own fields after these (async: staleness).
COLUMNS = ("round", "epoch", "epoch_float", "step", "train_loss", "train_acc", "test_loss",
           "test_acc", "lr", "images", "seconds", "bytes_averaged")
INTEGERS = ("round", "epoch", "step", "images", "bytes_averaged")  # the columns that count
# Names in a line's stage_seconds: the task stages, then the wall time no task of the round ran.
STAGES = (*keys.STAGES, "waiting")


# What every task result a line is built from must hold: field -> the kinds it may be.
_COUNT, _NUMBER = ("int",), ("int", "float")
RESULT_FIELDS = {"train": {"n": _COUNT, "loss_sum": _NUMBER, "correct": _COUNT,
                           "finite": ("bool",)},
                 "evaluate": {"n": _COUNT, "loss_sum": _NUMBER, "correct": _COUNT}}


def _kind(value) -> str:
    import numbers
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return "bool"
    if isinstance(value, numbers.Integral):
        return "int"
    return "float" if isinstance(value, numbers.Real) else type(value).__name__


def result_problem(value, stage: str) -> str | None:
    """What is wrong with a ``stage`` task's result (a metrics dict), in words; None if nothing.
    A worker of another version, or a hostile one, must not end the driver in a ``KeyError``.

    >>> result_problem({"n": 8, "loss_sum": 2.5, "correct": 3, "finite": True}, "train")
    >>> result_problem({"n": 8, "loss_sum": 2.5}, "evaluate")
    "a dict without 'correct'"
    >>> result_problem({"n": "8", "loss_sum": 2.5, "correct": 3}, "evaluate")
    "'n' of type str (expected int)"
    >>> result_problem([1, 2], "train")
    'a list, not a dict of metrics'
    """
    if not isinstance(value, dict):
        return f"a {type(value).__name__}, not a dict of metrics"
    for field, kinds in RESULT_FIELDS[stage].items():
        if field not in value:
            return f"a dict without {field!r}"
        kind = _kind(value[field])
        if kind not in kinds:
            return f"{field!r} of type {kind} (expected {' or '.join(kinds)})"
        if kinds == _COUNT and value[field] < 0:
            return f"{field!r} = {value[field]} (expected a count >= 0)"
    return None


def mean_of(results: list[dict], field: str) -> float:
    """``field`` summed over per-task metric dicts, divided once by their summed ``n``.

    >>> mean_of([{"n": 2, "correct": 2}, {"n": 6, "correct": 0}], "correct")
    0.25
    """
    return sum(r[field] for r in results) / sum(r["n"] for r in results)


def line(rnd, per_epoch: int, lr: float, train: list[dict], evaluated: list[dict], *,
         seconds: float, stage_seconds: dict, bytes_averaged: int, extra: dict) -> dict:
    """The metrics line of round ``rnd`` (a ``pipeline.core.schedule.Round``).

    ``train``: one metric dict per update of the round (``n``, ``loss_sum``, ``correct``);
    ``evaluated``: the same per test chunk, ``[]`` when the round was not evaluated; ``lr``: the
    learning rate of its last step; ``seconds``: wall time since the run started; ``extra``: the
    strategy's own fields. Means are taken over images, not over replicas or chunks.

    >>> from pipeline.core.schedule import Round
    >>> rnd = Round(index=3, epoch=0, step=6, steps=2, global_step=6, mix=True, epoch_end=False)
    >>> line(rnd, 16, 0.1, [{"n": 8, "loss_sum": 16.0, "correct": 2}], [], seconds=1.5,
    ...      stage_seconds={"train": 0.5}, bytes_averaged=64, extra={})
    ... # doctest: +NORMALIZE_WHITESPACE
    {'round': 3, 'epoch': 0, 'epoch_float': 0.5, 'step': 8, 'train_loss': 2.0, 'train_acc': 0.25,
     'lr': 0.1, 'images': 8, 'seconds': 1.5, 'stage_seconds': {'train': 0.5},
     'bytes_averaged': 64}
    """
    step = rnd.global_step + rnd.steps
    out = dict(round=rnd.index, epoch=rnd.epoch, epoch_float=round(step / per_epoch, 6),
               step=step, train_loss=mean_of(train, "loss_sum"),
               train_acc=mean_of(train, "correct"), lr=lr, images=sum(m["n"] for m in train))
    if evaluated:
        out.update(test_loss=mean_of(evaluated, "loss_sum"),
                   test_acc=mean_of(evaluated, "correct"))
    out.update(seconds=round(seconds, 4), stage_seconds=stage_seconds,
               bytes_averaged=bytes_averaged)
    out.update(extra)
    return out
