"""Exact, typed averaging of state dicts: float64 sums carried through a tree and divided once.

A state dict maps Chainer parameter paths to host arrays (``"/conv1/W"`` -> ``(64, 3, 3, 3)
float32``, ``"/bn1/N"`` -> ``() int64``). Averaging is a three-step reduction, as in
``dask/array/reductions.py``: :func:`leaf` turns one state into a :class:`Partial` (weighted
float64 sums and their total weight), :func:`combine` adds partials in the order given, and
:func:`finalize` divides once and casts every entry back to its own dtype. Floating entries are
averaged; the others (BatchNorm's integer counter ``N``) are taken from the lowest-index input.
Because the sums are carried, never the means, an uneven tree (7 replicas under fan-in 2) or
unequal weights (sample counts of gradient shards) give the exact weighted mean.

Float32 and float16 entries with integer weights are summed *exactly* in float64 (a product
of a 24-bit mantissa and a weight below 2**29 fits in 53 bits), so the result is independent of
the tree shape, bit for bit; float64 entries are exact up to the usual reassociation rounding.

>>> import numpy as np
>>> a = {"/l/W": np.array([1.0, 2.0], np.float32), "/bn/N": np.array(3)}
>>> b = {"/l/W": np.array([2.0, 4.0], np.float32), "/bn/N": np.array(5)}
>>> out = finalize(combine([leaf(a), leaf(b, weight=3)]))
>>> out["/l/W"], out["/l/W"].dtype, int(out["/bn/N"])
(array([1.75, 3.5 ], dtype=float32), dtype('float32'), 3)
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from pipeline.averaging import compiled
from pipeline.core.arrays import first_nonfinite, is_float

# Elements per block: a 512 KiB float64 scratch stays in L2 cache. Measured on this machine
# (2-core Xeon): the mean of two 100 MB float32 states takes 83 ms in blocks (combine_finalize)
# against 130-150 ms for whole-array combine then finalize; divide+cast alone 48 vs 109 ms.
_BLOCK = 1 << 16

State = Mapping[str, np.ndarray]


class Partial(NamedTuple):
    """Weighted float64 sums of some states, with their total weight.

    ``sums[k]`` is ``sum_i weight_i * state_i[k]`` in float64 (same shape as the entry), ``count``
    is ``sum_i weight_i``; ``first`` holds the non-float entries of the lowest-index input and
    ``dtypes`` the original dtypes of the float entries (used by :func:`finalize`).
    """

    sums: dict[str, np.ndarray]
    count: float
    first: dict[str, np.ndarray]
    dtypes: dict[str, np.dtype] | None = None


def _check_weight(weight) -> None:
    if not (isinstance(weight, (int, float, np.integer, np.floating)) and math.isfinite(weight)
            and weight > 0):
        raise ValueError(f"weight must be a finite number > 0, got {weight!r}")


def leaf(state: State, weight: float = 1) -> Partial:
    """One state as a partial: float entries become ``weight * value`` in float64.

    ``state``: ``{path: array}``, any shapes; ``weight``: the state's share, e.g. its sample count
    for gradients (sum of n_i * mean-grad_i, divided by the total n in :func:`finalize`).

    >>> p = leaf({"/W": np.ones(2, np.float32)}, weight=4)
    >>> p.sums["/W"], p.count, p.dtypes
    (array([4., 4.]), 4, {'/W': dtype('float32')})
    """
    _check_weight(weight)
    sums, first, dtypes = {}, {}, {}
    for key, value in state.items():
        value = np.asarray(value)
        if is_float(value):
            sums[key] = value.astype(np.float64)  # a copy: task inputs are never written
            if weight != 1:
                sums[key] *= weight
            dtypes[key] = value.dtype
        else:
            first[key] = value
    return Partial(sums, weight, first, dtypes)


def _as_partial_parts(item, index: int):
    """(sums-like dict, count, first, dtypes) of a Partial or of a raw state taken as weight 1."""
    if isinstance(item, Partial):
        return item.sums, item.count, item.first, item.dtypes
    if not isinstance(item, Mapping):
        raise TypeError(f"combine input {index} must be a Partial or a state dict, "
                        f"got {type(item).__name__}")
    sums, first, dtypes = {}, {}, {}
    for key, value in item.items():
        value = np.asarray(value)
        if is_float(value):
            sums[key], dtypes[key] = value, value.dtype  # no float64 copy; added into the sum
        else:
            first[key] = value
    return sums, 1, first, dtypes


def _check_same_entries(reference: Mapping, other: Mapping, index: int) -> None:
    if other.keys() != reference.keys():
        missing = sorted(set(reference) ^ set(other))
        raise ValueError(f"combine input {index} has different float entries: {missing[0]!r} "
                         f"is in one input but not the other")
    for key, value in other.items():
        if value.shape != reference[key].shape:
            raise ValueError(f"combine input {index} entry {key!r} has shape {value.shape}, "
                             f"input 0 has {reference[key].shape}")


def _checked_parts(partials) -> tuple[list, float]:
    """The inputs as (sums, count, first, dtypes) tuples, checked to hold the same entries, and
    their total weight."""
    if not partials:
        raise ValueError("combine needs at least one partial, got none")
    parts = [_as_partial_parts(item, i) for i, item in enumerate(partials)]
    count = parts[0][1]
    for index, (other, other_count, _, _) in enumerate(parts[1:], start=1):
        _check_same_entries(parts[0][0], other, index)
        count = count + other_count
    return parts, count


def combine(partials: Sequence[Partial | State]) -> Partial:
    """Add partials in the order given (the tree's replica-index order), never their means.

    An item may also be a raw state dict, counted as ``leaf(state, 1)`` but added straight into
    the float64 sum: the first tree level then reads float32 inputs without a float64 copy of
    each (bit-identical, since float32 -> float64 is exact). Inputs are not modified.

    >>> s = {"/W": np.array([1.0], np.float32)}
    >>> combine([s, leaf(s, weight=2)]).sums["/W"], combine([s, s]).count
    (array([3.]), 2)
    """
    parts, count = _checked_parts(partials)
    ref_sums, _, first, dtypes = parts[0]
    sums = {}
    for key, value in ref_sums.items():
        total = np.array(value, dtype=np.float64)  # a copy, exact widening
        flat = total.reshape(-1)
        others = [np.ravel(p[0][key]) for p in parts[1:]]
        widen_buf = np.empty(min(_BLOCK, flat.size))
        for block in _blocks(flat.size):
            for other in others:
                _add_into(flat[block], other[block], widen_buf[: block.stop - block.start])
        sums[key] = total
    return Partial(sums, count, first, dtypes)


def _dtypes_of(like) -> dict[str, np.dtype]:
    return {key: value.dtype if isinstance(value, (np.ndarray, np.generic)) else np.dtype(value)
            for key, value in like.items()}


def _add_into(total: np.ndarray, value: np.ndarray, scratch: np.ndarray) -> None:
    """``total += value`` for a float64 block; a narrower value is widened into ``scratch``
    first (exact; an explicit widening copy is ~1.3x faster here than a mixed-dtype add)."""
    if value.dtype != np.float64:
        np.copyto(scratch, value)
        value = scratch
    np.add(total, value, out=total)


def _blocks(size: int):
    for start in range(0, size, _BLOCK):
        yield slice(start, min(start + _BLOCK, size))


def _mean_blocks(arrays: Sequence[np.ndarray], count, dtype: np.dtype) -> np.ndarray:
    """``(sum(arrays) / count).astype(dtype)``, summed in float64 in cache-sized blocks.

    Same bits as summing whole arrays in order (each element sees the same float64 adds and
    the same division); the float64 sum of a block never leaves the cache.
    """
    flat = [np.ravel(a) for a in arrays]
    size = flat[0].size
    out = np.empty(size, dtype)
    if compiled.mean_into(flat, count, out):  # one compiled pass, the same bits
        return out.reshape(np.shape(arrays[0]))
    acc_buf, widen_buf = np.empty(min(_BLOCK, size)), np.empty(min(_BLOCK, size))
    for block in _blocks(size):
        n = block.stop - block.start
        acc, widen = acc_buf[:n], widen_buf[:n]
        np.copyto(acc, flat[0][block])  # exact widening
        for other in flat[1:]:
            _add_into(acc, other[block], widen)
        np.divide(acc, count, out=acc)
        np.copyto(out[block], acc, casting="same_kind")
    return out.reshape(np.shape(arrays[0]))


def _finish(sums_of: Callable[[str], list], count, first: Mapping, recorded, keys,
            like) -> dict[str, np.ndarray]:
    """Output dict for finalize/combine_finalize: float entries via _mean_blocks, others as is."""
    dtypes = _dtypes_of(like) if like is not None else recorded
    if dtypes is None:
        raise ValueError("finalize needs like= (a state dict or {path: dtype}): "
                         "the partial records no dtypes")
    out = {}
    for key in (list(like) if like is not None else [*keys, *first]):
        if key in keys:
            if key not in dtypes:
                raise ValueError(f"finalize: like has no dtype for entry {key!r}")
            out[key] = _mean_blocks(sums_of(key), count, np.dtype(dtypes[key]))
        elif key in first:
            out[key] = first[key]
        else:
            raise ValueError(f"finalize: entry {key!r} of like is not in the partial")
    return out


def finalize(partial: Partial, like: Mapping | None = None) -> dict[str, np.ndarray]:
    """Divide the sums once by the total weight and cast each entry back to its dtype.

    ``like``: a state dict or ``{path: dtype}`` giving the output dtypes; defaults to the dtypes
    recorded in the partial. Non-float entries come from ``partial.first``. Keys come out in
    the order of ``like`` (or of the sums, then the non-float entries).

    >>> half = [{"/W": np.array([v], np.float16)} for v in (1.0, 2.0)]
    >>> p = combine([leaf(s) for s in half])
    >>> finalize(p)["/W"], finalize(p, like={"/W": np.float64})["/W"].dtype
    (array([1.5], dtype=float16), dtype('float64'))
    """
    return _finish(lambda key: [partial.sums[key]], partial.count, partial.first,
                   partial.dtypes, partial.sums.keys(), like)


def combine_finalize(partials: Sequence[Partial | State],
                     like: Mapping | None = None) -> dict[str, np.ndarray]:
    """``finalize(combine(partials), like)`` bit for bit, in one blocked pass per entry.

    The float64 sums are never materialised: for K float32 states of L bytes this reads K*L
    and writes L, where combine then finalize write and re-read 2L of float64 (measured on
    this machine for two 10 MB states: 7 ms instead of 21 ms). A tree's root uses it.

    >>> s = [{"/W": np.array([1.0, 2.0], np.float32)}, {"/W": np.array([2.0, 2.0], np.float32)}]
    >>> combine_finalize(s)["/W"]
    array([1.5, 2. ], dtype=float32)
    """
    parts, count = _checked_parts(partials)
    ref_sums, _, first, dtypes = parts[0]
    return _finish(lambda key: [p[0][key] for p in parts], count, first, dtypes,
                   ref_sums.keys(), like)


def mean(states: Sequence[State], weights: Sequence[float] | None = None) -> dict[str, np.ndarray]:
    """Weighted mean of states in one call: ``finalize(combine([leaf(s, w) ...]))``.

    Gradients use the same call with ``weights`` = samples per shard.

    >>> mean([{"/g": np.array([1.0])}, {"/g": np.array([4.0])}], weights=[2, 1])["/g"]
    array([2.])
    """
    if weights is None:
        return combine_finalize(list(states))
    if len(weights) != len(states):
        raise ValueError(f"weights must have one entry per state ({len(states)}), "
                         f"got {len(weights)}")
    return combine_finalize([leaf(s, w) for s, w in zip(states, weights)])


def outer_step(previous: State, averaged: State, momentum_buf: Mapping | None, lr: float,
               momentum: float, nesterov: bool = True):
    """DiLoCo's outer optimizer: SGD (Nesterov) on the outer gradient ``previous - averaged``.

    ``previous``: the parameters every replica started the round from; ``averaged``: the mean of
    the replicas' parameters after it; ``momentum_buf``: float64 ``{path: array}`` from the last
    call, or None at the first. Math per float entry, in float64 (as ``torch.optim.SGD``)::

        delta = previous - averaged
        buf   = momentum * buf + delta          (buf = delta at the first step)
        step  = delta + momentum * buf  if nesterov else  buf
        new   = previous - lr * step            (cast back to the entry's dtype)

    Returns ``(new_params, new_momentum_buf)``; the buffer is None when ``momentum == 0``.
    ``lr=1, momentum=0`` is plain averaging and returns ``averaged``'s arrays as they are, bit
    for bit. Non-float entries pass through from ``averaged``.

    >>> prev, avg = {"/W": np.array([1.0], np.float32)}, {"/W": np.array([0.5], np.float32)}
    >>> outer_step(prev, avg, None, lr=1.0, momentum=0.0)[0]["/W"] is avg["/W"]
    True
    >>> new, buf = outer_step(prev, avg, None, lr=1.0, momentum=0.5)
    >>> new["/W"], buf["/W"]
    (array([0.25], dtype=float32), array([0.5]))
    """
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    if lr == 1 and momentum == 0:
        return dict(averaged), None
    new, buf = {}, {}
    for key, avg in averaged.items():
        avg = np.asarray(avg)
        if not is_float(avg):
            new[key] = avg
            continue
        if key not in previous:
            raise ValueError(f"outer_step: previous has no entry {key!r}")
        delta = np.subtract(previous[key], avg, dtype=np.float64)
        step = delta
        if momentum:
            old = None if momentum_buf is None else momentum_buf.get(key)
            buf[key] = delta if old is None else momentum * old + delta
            step = delta + momentum * buf[key] if nesterov else buf[key]
        new[key] = (previous[key] - lr * step).astype(avg.dtype)
    return new, (buf if momentum else None)


def squared_distance(a: State, b: State) -> float:
    """Sum over float entries of ``||a - b||^2``, in float64 (a replica's displacement).

    >>> squared_distance({"W": np.float32([1, 2]), "N": np.int64(3)}, {"W": np.float32([0, 0])})
    5.0
    """
    total = 0.0
    for key, value in a.items():
        if is_float(value) and key in b:
            d = np.subtract(value, b[key], dtype=np.float64)
            total += float(np.dot(d.ravel(), d.ravel()))
    return total


def nbytes(state: State) -> int:
    """Total bytes of the arrays in a state dict.

    >>> nbytes({"/W": np.zeros((2, 3), np.float32), "/N": np.array(1, np.int64)})
    32
    """
    return int(sum(np.asarray(value).nbytes for value in state.values()))


def is_finite(state: State) -> bool:
    """Whether every entry is finite (``first_nonfinite`` finds none; integers always are).

    >>> is_finite({"/a": np.ones(2, np.float16)}), is_finite({"/a": np.array([np.inf])})
    (True, False)
    """
    return first_nonfinite(state) is None
