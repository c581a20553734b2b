"""Build a tree reduction of futures as distributed tasks, children grouped in input-index order.

The shape mirrors ``dask.array.reductions._tree_reduce`` / ``partial_reduce``: inputs are cut
into consecutive groups of ``fan_in`` (``toolz.partition_all`` over the *index*, never over
completion order), each group becomes one task, and levels repeat until one task is left; that
root also applies ``finalize`` (dask's ``aggregate``). The depth is ``ceil(log(K, fan_in))``;
``fan_in`` plays ``split_every``'s part.

Two choices differ from dask, both to move fewer bytes:

- ``leaf`` (dask's per-chunk function) is fused into the first-level tasks rather than run in
  a task of its own. Dask's ``chunk`` shrinks a block; here it *grows* one (a float32 state
  becomes float64 sums), so running it next to its input would ship twice the bytes and add
  K tasks per round. In the fused form the float32 state travels and the float64 copy is made
  where it is consumed.
- A group with a single child below the root gets no task: the child is handed up unchanged
  (a K=5, fan-in-2 tree has tasks (0,0), (0,1), (1,0) and the root (2,0), which takes input 4
  itself). A one-child task would only copy, and would ship float64 sums instead of the
  float32 input.

Keys are ``keys.make(name, token, *coords, level, index)``, so the dashboard groups every node of
every round under ``name`` (``key_split``) and the same inputs give the same keys.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from dask.utils import key_split

from pipeline.averaging.order import tree_plan
from pipeline.core import keys


def _node(*children, raw: tuple[bool, ...], reduce: Callable, leaf: Callable | None):
    """One tree task: leaf the raw inputs (if a leaf is given), then reduce them in order."""
    return reduce([leaf(c) if is_raw and leaf is not None else c
                   for c, is_raw in zip(children, raw)])


def _then(items, *, combine: Callable, finalize: Callable):
    """The root's default reduction: ``finalize(combine(items))``."""
    return finalize(combine(items))


def _root_fn(combine, finalize, combine_finalize):
    return combine_finalize or partial(_then, combine=combine, finalize=finalize)


def _build(inputs: Sequence, fan_in: int, make: Callable):
    """Walk ``tree_plan`` and call ``make(level, index, children, raw, is_root, first)`` per
    task, ``first`` being the index of the first input under it."""
    nodes, raw, firsts = list(inputs), [True] * len(inputs), list(range(len(inputs)))
    plan = tree_plan(len(nodes), fan_in)
    for level, groups in enumerate(plan):
        is_root = level == len(plan) - 1
        next_nodes, next_raw, next_firsts = [], [], []
        for index, group in enumerate(groups):
            next_firsts.append(firsts[group[0]])
            if len(group) == 1 and not is_root:  # hand a lone child up unchanged
                next_nodes.append(nodes[group[0]])
                next_raw.append(raw[group[0]])
                continue
            children = [nodes[i] for i in group]
            flags = tuple(raw[i] for i in group)
            next_nodes.append(make(level, index, children, flags, is_root, firsts[group[0]]))
            next_raw.append(False)
        nodes, raw, firsts = next_nodes, next_raw, next_firsts
    return nodes[0]


def reduce_local(inputs: Sequence, combine: Callable, finalize: Callable, *, fan_in: int,
                 leaf: Callable | None = None, combine_finalize: Callable | None = None):
    """The same tree as :func:`tree_reduce`, evaluated in this process (the test oracle).

    >>> reduce_local([1, 2, 3, 4, 5], sum, lambda s: s * 10, fan_in=2)
    150
    """
    root = _root_fn(combine, finalize, combine_finalize)

    def make(level, index, children, raw, is_root, first):
        return _node(*children, raw=raw, reduce=root if is_root else combine, leaf=leaf)
    return _build(inputs, fan_in, make)


def _prefix(name: str, token: str) -> str:
    """``keys.prefix``, checked to label the dashboard with ``name`` (``key_split`` drops the
    token)."""
    prefix = keys.prefix(name, token)
    if key_split(prefix) != name:
        raise ValueError(f"the stage name must be what dask's key_split keeps: "
                         f"key_split({prefix!r}) = {key_split(prefix)!r}, not {name!r}")
    return prefix


def tree_reduce(client, futures: Sequence, combine: Callable, finalize: Callable, *,
                fan_in: int, name: str = "average", token: str, coords: tuple = (),
                leaf: Callable | None = None, resources: dict | None = None,
                combine_finalize: Callable | None = None, workers: Sequence[str] | None = None):
    """Submit a tree of ``combine`` tasks over ``futures``; the root applies ``finalize``.

    ``futures``: K futures (or values) in replica-index order; each group of ``fan_in``
    consecutive children becomes the task ``keys.make(name, token, *coords, level, index)``
    computing ``combine([leaf(x) for x in children])`` (``leaf`` only for inputs, i.e. in the
    first tasks that see them), and the root ``finalize(combine(...))``, or
    ``combine_finalize(...)`` when given (a fused equivalent such as
    ``averaging.combine_finalize``, which never materialises the float64 sums at the root).
    ``coords`` are ints or strs (dask keys allow no bools). ``resources`` goes to every
    ``client.submit``. ``workers``: the worker of each input; a task then runs on the worker of
    its first input when that worker is alive (as an MPI tree reduce runs node (l, i) on the
    rank of its first leaf), else anywhere. Returns the root's future.

    With ``combine=averaging.combine`` and ``finalize=averaging.finalize`` this is the exact
    mean of the states; for float32 states it equals ``finalize(combine(states))`` bit for bit
    whatever ``fan_in``.
    """
    prefix = _prefix(name, token)
    if not futures:
        raise ValueError("tree_reduce needs at least one future, got none")
    root = _root_fn(combine, finalize, combine_finalize)

    def make(level, index, children, raw, is_root, first):
        task = partial(_node, raw=raw, reduce=root if is_root else combine, leaf=leaf)
        pin = dict(workers=[workers[first]], allow_other_workers=True) if workers else {}
        return client.submit(task, *children, key=(prefix, *coords, level, index), pure=False,
                             resources=resources, **pin)
    return _build(futures, fan_in, make)
