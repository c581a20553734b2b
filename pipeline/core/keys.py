"""Task keys: built and parsed here and nowhere else.

A key is ``("<stage>-<8-hex run token>", *coords)``: dask's ``key_split`` drops the token, so the
dashboard groups tasks by stage, and the coordinates (round, replica, level, ...) say where in
the run a task sits. The stage is the name of the task function that runs, so a label on the
dashboard greps to the code. The token changes when a failed attempt is replayed, so replayed
tasks never meet a key the scheduler is still forgetting.
"""
from __future__ import annotations

import ast
import re
import uuid

# Stages of a run, in pipeline order; stage_seconds in metrics.jsonl reports these.
STAGES = ("load", "decode", "augment", "train", "average", "update", "apply", "evaluate")
# Prefixes of the dataset's own keys (dask array blocks), charged to the "load" stage.
_LOAD_PREFIXES = ("load", "images", "labels")
_TOKEN = re.compile(r"^[0-9a-f]{8}$")
_PREFIX = re.compile(r"^([a-z_]+)-[0-9a-f]+$")


def new_token() -> str:
    """A fresh 8-hex run token.

    >>> len(new_token()) == 8 and new_token() != new_token()
    True
    """
    return uuid.uuid4().hex[:8]


def prefix(stage: str, token: str) -> str:
    """The head of a key, ``"<stage>-<token>"``; also the name of a dask array's blocks.

    >>> prefix("images", "0123abcd")
    'images-0123abcd'
    """
    if not _TOKEN.match(token):
        raise ValueError(f"a key token is 8 lowercase hex digits, got {token!r}")
    return f"{stage}-{token}"


def suffix(token: str) -> str:
    """The end of every key prefix of the run (attempt) with ``token``: how the stalled-task
    watchdog tells that run's tasks from others on the scheduler (:func:`stage_in_run`).

    >>> suffix("0123abcd")
    '-0123abcd'
    """
    return prefix("", token)


def stage_in_run(key, run_suffix: str) -> str | None:
    """The stage of ``key`` when it is a task of the run whose prefixes end with ``run_suffix``
    (:func:`suffix`), else None: also extra stages of an average (``take``, ``reduce``).

    >>> stage_in_run(("train-0123abcd", 3, 1), "-0123abcd"), stage_in_run("x", "-0123abcd")
    ('train', None)
    """
    name = key[0] if isinstance(key, tuple) and key and isinstance(key[0], str) else None
    if name is None or not name.endswith(run_suffix):
        return None
    return name[:-len(run_suffix)]


def make(stage: str, token: str, *coords) -> tuple:
    """The key of one task.

    >>> make("train", "0123abcd", 3, 1)
    ('train-0123abcd', 3, 1)
    """
    return (prefix(stage, token), *coords)


def _as_tuple(key):
    """A key as a tuple, also from its string form (task-stream records may carry either)."""
    if isinstance(key, tuple):
        return key
    text = str(key)
    if text.startswith("("):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return (text,)
        return value if isinstance(value, tuple) else (text,)
    return (text,)


def stage_of(key) -> str | None:
    """The stage a key belongs to (the dataset's blocks count as "load"); None if it is not ours.

    >>> stage_of(("average-0123abcd", 4, 0, 1)), stage_of("('images-9f9f9f9f', 2, 0, 0, 0)")
    ('average', 'load')
    >>> stage_of("finalize-abc") is None
    True
    """
    head = _as_tuple(key)[0]
    match = _PREFIX.match(str(head))
    if not match:
        return None
    stage = match.group(1)
    if stage in _LOAD_PREFIXES:
        return "load"
    return stage if stage in STAGES else None


def is_block(key) -> bool:
    """Whether a key is a block of the dataset, loaded once (charged to "load"): the CIFAR
    arrays' blocks and cached image-folder ``("decode-<tok>", i)`` blocks; per-round
    ``("decode-<tok>", round, replica, piece)`` tasks are not.

    >>> is_block(("decode-0123abcd", 3)), is_block(("decode-0123abcd", 3, 1, 0))
    (True, False)
    """
    parts = _as_tuple(key)
    stage = stage_of(parts)
    return stage == "load" or (stage == "decode" and len(parts) == 2)


def round_of(key) -> int | None:
    """The round of a per-round key (its first coordinate); None for keys without one.

    >>> round_of(("train-0123abcd", 7, 2)), round_of("('evaluate-0123abcd', 12, 0)")
    (7, 12)
    >>> round_of(("images-0123abcd", 0, 0, 0, 0)) is None
    True
    """
    parts = _as_tuple(key)
    if stage_of(parts) in (None, "load") or len(parts) < 2 or not isinstance(parts[1], int):
        return None
    return parts[1]


def train_replica(key) -> int | None:
    """The replica of a ``train-`` key (or of one of its picks); None for any other key.

    >>> train_replica(("train-0123abcd", 7, 2)), train_replica(("train-0123abcd", 7, 2, "opt"))
    (2, 2)
    >>> train_replica(("average-0123abcd", 7, 2)) is None
    True
    """
    parts = _as_tuple(key)
    if stage_of(parts) != "train" or len(parts) < 3 or not isinstance(parts[2], int):
        return None
    return parts[2]
