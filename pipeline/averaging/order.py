"""The one order in which replicas' states are added: ``tree_plan``'s tree as nodes that any
averaging algorithm can evaluate whole, in pieces on different hosts, or shard by shard.

Every algorithm (``tree``, ``sharded``, ``hierarchical``) adds the same float64 numbers in the
same association: the tree of ``tree_plan(K, fan_in)`` over replica indices. An algorithm may
compute some subtrees in one place (a host's replicas) and finish the tree elsewhere
(:func:`frontier`, :func:`evaluate` with ``known``), or run the whole tree on one byte range of
the state; each element still sees the same additions, so the averaged state is the same, bit
for bit, whatever the algorithm, the placement of replicas and the number of shards.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Union


def tree_plan(n: int, fan_in: int) -> list[list[tuple[int, ...]]]:
    """Groups per level; each group lists its children's positions in the level below.

    Level 0's positions are input indices; level l+1's are positions in level l's list of
    groups. The last level has one group: the root.

    >>> tree_plan(5, 2)
    [[(0, 1), (2, 3), (4,)], [(0, 1), (2,)], [(0, 1)]]
    >>> tree_plan(3, 4)
    [[(0, 1, 2)]]
    """
    if n < 1:
        raise ValueError(f"a tree reduction needs at least one input, got {n}")
    if int(fan_in) != fan_in or fan_in < 2:
        raise ValueError(f"fan_in must be an integer >= 2, got {fan_in!r}")
    levels, width = [], n
    while True:
        groups = [tuple(range(s, min(s + fan_in, width))) for s in range(0, width, fan_in)]
        levels.append(groups)
        if len(groups) == 1:
            return levels
        width = len(groups)


class Node(NamedTuple):
    """One addition task of the plan: ``combine`` of its children in order (the root also
    divides). A child is a replica index (an input) or another Node."""
    level: int
    index: int
    children: tuple
    first: int  # the replicas under this node are first .. stop-1
    stop: int


Child = Union[int, Node]


def build(n: int, fan_in: int) -> Node:
    """The root of ``tree_plan(n, fan_in)`` as nodes; a lone child below the root is handed up
    unchanged (no node), as ``pipeline.averaging.reduction`` does.

    >>> root = build(5, 2)
    >>> root.level, [c if isinstance(c, int) else (c.level, c.index) for c in root.children]
    (2, [(1, 0), 4])
    """
    nodes: list[Child] = list(range(n))
    plan = tree_plan(n, fan_in)
    for level, groups in enumerate(plan):
        is_root = level == len(plan) - 1
        next_nodes: list[Child] = []
        for index, group in enumerate(groups):
            if len(group) == 1 and not is_root:
                next_nodes.append(nodes[group[0]])
                continue
            children = tuple(nodes[i] for i in group)
            next_nodes.append(Node(level, index, children, span(children[0])[0],
                                   span(children[-1])[1]))
        nodes = next_nodes
    return nodes[0]


def span(child: Child) -> tuple[int, int]:
    """Replica range ``(first, stop)`` under a child."""
    return (child, child + 1) if isinstance(child, int) else (child.first, child.stop)


def ident(child: Child):
    """A hashable name for a child, usable in task keys: the replica index, or (level, index)."""
    return child if isinstance(child, int) else (child.level, child.index)


def frontier(root: Node, local: Sequence[int] | set) -> list[Child]:
    """The largest subtrees whose replicas are all in ``local``, in replica order.

    >>> [ident(c) for c in frontier(build(4, 2), {0, 1, 3})]
    [(0, 0), 3]
    >>> [ident(c) for c in frontier(build(4, 2), {0, 1, 2, 3})]
    [(1, 0)]
    """
    local = set(local)

    def walk(child: Child) -> list[Child]:
        first, stop = span(child)
        if all(r in local for r in range(first, stop)):
            return [child]
        if isinstance(child, int):
            return []
        return [c for sub in child.children for c in walk(sub)]
    return walk(root)


def evaluate(root: Node, known: Mapping, combine: Callable, root_fn: Callable,
             top: Child | None = None):
    """Compute ``top`` (default: the whole tree, with ``root_fn`` at the root) from known values.

    ``known``: ``{ident(child): value}`` for the inputs (replica indices) and for any nodes
    computed elsewhere; a node it lacks is computed here as ``combine`` of its children in
    order (``root_fn`` of them at the root).

    >>> evaluate(build(3, 2), {0: 1, 1: 2, 2: 3}, sum, lambda xs: sum(xs) / 3)
    2.0
    >>> evaluate(build(3, 2), {(0, 0): 10, 2: 3}, sum, lambda xs: sum(xs) / 3)
    4.333333333333333
    """
    def value(child: Child):
        name = ident(child)
        if name in known:
            return known[name]
        if isinstance(child, int):
            raise KeyError(f"no value for replica {child}")
        items = [value(c) for c in child.children]
        return (root_fn if child is root else combine)(items)
    return value(root if top is None else top)
