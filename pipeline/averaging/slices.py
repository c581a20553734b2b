"""A state cut into S shards by byte ranges of its flattened float entries, reduced shard by shard
and put back together.

The float entries, in the state's order and flattened in C order, form one stream of elements;
shard ``s`` holds the elements whose first byte lies in ``[s*T//S, (s+1)*T//S)``, ``T`` being the
bytes of the float entries at their own dtypes (so a float64 partial sum and the float32 state
it came from are cut at the same elements). A shard's value is itself a state dict of 1-D pieces
under the same keys, or a :class:`~pipeline.averaging.exact.Partial` of such pieces, so
``exact.combine`` and ``combine_finalize`` reduce shards unchanged and every element sees the
same float64 additions as in a whole-state reduction. Non-float entries (BatchNorm's ``N``,
taken from the lowest-index replica) travel with shard 0.

>>> import numpy as np
>>> state = {"/W": np.arange(6, dtype=np.float32).reshape(2, 3), "/N": np.array(4)}
>>> pieces = [take(state, 2, s) for s in range(2)]
>>> pieces[0].value["/W"], sorted(pieces[1].value)
(array([0., 1., 2.], dtype=float32), ['/W'])
>>> out = assemble(pieces)
>>> out["/W"].tolist(), int(out["/N"])
([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], 4)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from pipeline.averaging import exact
from pipeline.averaging.order import Node, evaluate


class Layout(NamedTuple):
    """Where each element of a state goes: float entries with their shapes and dtypes, the
    non-float entries, and the number of shards."""
    entries: tuple  # ((key, shape, dtype name), ...) of the float entries, in the state's order
    others: tuple  # keys of the non-float entries (shard 0 carries them)
    n_shards: int
    order: tuple = ()  # every key in the order assemble gives them back (default: the state's)

    @property
    def nbytes(self) -> int:
        """Bytes of the float entries at their own dtypes (the ``T`` of the cut)."""
        return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in self.entries)

    def bounds(self, index: int) -> tuple:
        """``((key, lo, hi), ...)``: the elements ``lo:hi`` of each flattened float entry that
        fall in shard ``index`` (entries with none are left out).

        >>> lay = Layout((("/a", (3,), "float32"), ("/b", (2,), "float64")), (), 2)
        >>> lay.bounds(0), lay.bounds(1)
        ((('/a', 0, 3), ('/b', 0, 1)), (('/b', 1, 2),))
        """
        if not 0 <= index < self.n_shards:
            raise ValueError(f"shard index must be in 0..{self.n_shards - 1}, got {index}")
        total = self.nbytes
        lo_byte = index * total // self.n_shards
        hi_byte = (index + 1) * total // self.n_shards
        out, offset = [], 0
        for key, shape, dt in self.entries:
            size, item = int(np.prod(shape)), np.dtype(dt).itemsize
            lo = min(max(-((offset - lo_byte) // item), 0), size)  # ceil((lo_byte - offset)/item)
            hi = min(max(-((offset - hi_byte) // item), 0), size)
            if hi > lo:
                out.append((key, lo, hi))
            offset += size * item
        return tuple(out)


class Piece(NamedTuple):
    """Shard ``index`` of one state or partial: ``value`` is a dict of 1-D pieces (plus the
    non-float entries in shard 0), or a Partial of such pieces."""
    layout: Layout
    index: int
    value: object


def layout_of(value, n_shards: int) -> Layout:
    """The layout of a state dict or a Partial (whose float dtypes are the recorded ones)."""
    if int(n_shards) != n_shards or n_shards < 1:
        raise ValueError(f"n_shards must be an integer >= 1, got {n_shards!r}")
    if isinstance(value, exact.Partial):
        if value.dtypes is None:
            raise ValueError("a Partial without recorded dtypes cannot be sharded")
        entries = tuple((k, tuple(np.shape(v)), np.dtype(value.dtypes[k]).name)
                        for k, v in value.sums.items())
        return Layout(entries, tuple(value.first), int(n_shards),
                      tuple(value.sums) + tuple(value.first))
    if not isinstance(value, Mapping):
        raise TypeError(f"can shard a state dict or a Partial, not {type(value).__name__}")
    entries, others = [], []
    for key, array in value.items():
        array = np.asarray(array)
        if exact.is_float(array):
            entries.append((key, array.shape, array.dtype.name))
        else:
            others.append(key)
    return Layout(tuple(entries), tuple(others), int(n_shards), tuple(value))


def _flat_pieces(arrays: Mapping, bounds) -> dict:
    # reshape(-1) of a C-contiguous array is a view, so are its slices: nothing is copied
    # here, and Dask sends exactly the piece's bytes.
    return {key: np.asarray(arrays[key]).reshape(-1)[lo:hi] for key, lo, hi in bounds}


def take(value, n_shards: int, index: int) -> Piece:
    """Shard ``index`` of ``n_shards`` of a state dict or a Partial (views, no copy)."""
    layout = layout_of(value, n_shards)
    bounds = layout.bounds(index)
    if isinstance(value, exact.Partial):
        first = dict(value.first) if index == 0 else {}
        dtypes = {key: value.dtypes[key] for key, _, _ in bounds}
        return Piece(layout, index, exact.Partial(_flat_pieces(value.sums, bounds),
                                                      value.count, first, dtypes))
    out = _flat_pieces(value, bounds)
    if index == 0:
        out.update({key: value[key] for key in layout.others})
    return Piece(layout, index, out)


def _check_pieces(pieces: Sequence[Piece], what: str) -> Piece:
    ref = pieces[0]
    for i, piece in enumerate(pieces):
        if not isinstance(piece, Piece):
            raise TypeError(f"{what}: input {i} is a {type(piece).__name__}, not a Piece")
        if piece.layout[:3] != ref.layout[:3]:  # key order may differ: state vs partial
            raise ValueError(f"{what}: input {i} was cut from a state with different entries, "
                             f"shapes or dtypes than input 0")
    return ref


def reduce_pieces(pieces: Mapping, root: Node) -> Piece:
    """The mean of one shard over all replicas, added in ``root``'s order.

    ``pieces``: ``{reduce_order.ident(child): Piece}`` for a frontier of the plan covering every
    replica (all replica indices for a flat reduction; some subtrees' partials for a
    hierarchical one), all the same shard of the same layout.
    """
    if not pieces:
        raise ValueError("reduce_pieces needs at least one piece")
    ref = _check_pieces(list(pieces.values()), "reduce_pieces")
    if any(p.index != ref.index for p in pieces.values()):
        raise ValueError("reduce_pieces: the pieces are not all the same shard")
    values = {key: piece.value for key, piece in pieces.items()}
    mean = evaluate(root, values, exact.combine, exact.combine_finalize)
    # The mean's keys come in exact.finalize's order: float entries, then the others.
    order = tuple(key for key, _, _ in ref.layout.entries) + ref.layout.others
    return Piece(ref.layout._replace(order=order), ref.index, mean)


def assemble(pieces: Sequence[Piece]) -> dict[str, np.ndarray]:
    """The whole state from its shards, in shard order; keys in the layout's order (a mean's:
    float entries then the others, as ``exact.finalize`` gives them). Fresh arrays."""
    if not pieces:
        raise ValueError("assemble needs the pieces of every shard, got none")
    ref = _check_pieces(pieces, "assemble")
    if [p.index for p in pieces] != list(range(ref.layout.n_shards)):
        raise ValueError(f"assemble needs shards 0..{ref.layout.n_shards - 1} in order, got "
                         f"{[p.index for p in pieces]}")
    out = {}
    for key, shape, dt in ref.layout.entries:
        parts = [p.value[key] for p in pieces if key in p.value]
        flat = np.concatenate(parts) if parts else np.empty(0, dt)
        out[key] = flat.reshape(shape)
    out.update({key: np.array(ref.value[key]) for key in ref.layout.others})
    return {key: out[key] for key in (ref.layout.order or out)}
