"""Questions about the host arrays of a state dict that every layer asks: which entries are
floats, where the first NaN or infinity is, and whether a task's output has its input's form.

A state dict maps Chainer parameter paths to host NumPy arrays (``"/conv1/W"`` -> ``(64, 3, 3, 3)
float32``, ``"/bn1/N"`` -> ``() int64``).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def is_float(value) -> bool:
    """Whether an entry is averaged: real floating dtypes only (not ints, bools or complex).

    >>> is_float(np.zeros(2, np.float16)), is_float(np.array(3)), is_float(np.zeros(1, complex))
    (True, False, False)
    """
    return np.issubdtype(np.asarray(value).dtype, np.floating)


def first_nonfinite(state: Mapping) -> str | None:
    """The first key (dict order) whose array holds a NaN or an infinity, or None. Float and
    complex entries are scanned; integer and bool ones are finite by construction.

    >>> first_nonfinite({"/a": np.ones(2), "/b": np.array([1.0, np.nan]), "/n": np.array(3)})
    '/b'
    >>> first_nonfinite({"/z": np.array([1j, complex("inf")])})
    '/z'
    """
    for key, value in state.items():
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.inexact) and not np.isfinite(value).all():
            return key
    return None


def state_problem(state, like: Mapping) -> str | None:
    """What makes ``state`` (a task's output) not a state of ``like``'s form (its input: same
    keys, each a NumPy array of the same dtype and shape), in words; None if nothing. Checked
    before anything reads the values: a worker of another version, or a hostile one, must not
    end the run in a ``KeyError`` or ship a wrong-sized array on to the average.

    >>> like = {"/W": np.zeros((2, 3), np.float32), "/N": np.array(4)}
    >>> state_problem({"/W": np.ones((2, 3), np.float32), "/N": np.array(5)}, like)
    >>> state_problem([1, 2], like), state_problem({"/W": like["/W"]}, like)
    ('a list, not a dict of arrays', "a state without '/N' (and 0 more missing)")
    >>> state_problem({**like, "/x": 1}, like)
    "a state with an unexpected entry '/x' (and 0 more)"
    >>> state_problem({"/W": np.zeros((4000, 4000), np.float32), "/N": np.array(4)}, like)
    "'/W' of float32[4000, 4000] (expected float32[2, 3])"
    >>> state_problem({"/W": like["/W"].astype(object), "/N": "4"}, like)
    "'/W' of object[2, 3] (expected float32[2, 3])"
    """
    if not isinstance(state, Mapping):
        return f"a {type(state).__name__}, not a dict of arrays"
    missing = [k for k in like if k not in state]
    if missing:
        return f"a state without {missing[0]!r} (and {len(missing) - 1} more missing)"
    extra = [k for k in state if k not in like]
    if extra:
        return (f"a state with an unexpected entry {printable_key(extra[0])} "
                f"(and {len(extra) - 1} more)")
    for key, value in like.items():
        got, want = state[key], np.asarray(value)
        if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != want.shape:
            return f"{key!r} of {describe(got)} (expected {describe(want)})"
    return None


def describe(value) -> str:
    """``float32[2, 3]`` for an array, the type's name for anything else.

    >>> describe(np.zeros((2, 3), np.float32)), describe(np.array(1, np.int64)), describe("x")
    ('float32[2, 3]', 'int64[]', 'str')
    """
    if not isinstance(value, np.ndarray):
        return type(value).__name__
    return f"{value.dtype}[{', '.join(map(str, value.shape))}]"


def printable_key(key) -> str:
    """A key as it is quoted in a message, cut to 80 characters (a hostile key may be huge).

    >>> printable_key("/x"), printable_key("y" * 100)[-6:], printable_key(3)
    ("'/x'", 'yyy...', '3')
    """
    text = repr(key)
    return text if len(text) <= 80 else text[:77] + "..."
