"""The augment- stage, one path for training and for arrays: the positions of an epoch decide the parameters.

Training's ``augment`` tasks gather a replica's shard from the persisted blocks; ``augment_array``
maps a policy over fixed global-index chunks of a Dask image array. Both end in
``augment_positions``, so an image's augmentation is the same whichever path produced it.

The chunk plan comes from the config (``augment.chunk`` images per chunk, by global index), never
from the number of workers, and chunk j of epoch e draws its parameters from
``rng_for(seed, "augment", e, j)`` (`augment_rng`), the same derivation as
``aug.sample_for_positions``. So the augmented bytes of every image are a function of
(seed, epoch, position) only: one worker or twenty, threads or processes, give the same result.

Graph shape: one ``("augment-<token>", epoch, j)`` task per chunk (dashboard label "augment"),
kept out of Dask's low-level fusion so the label and the resources annotation reach the
scheduler, and a layer of aliases ``("augmented-<token>", j, 0, 0, 0)`` that are the blocks of
the returned array.

Resources: dask's low-level fusion drops layer annotations (dask/dask#7036, #10325), so the
returned array carries an optimizer that re-attaches them to the (unfused) augment- keys;
``client.compute``/``persist`` of the array itself honours ``resources``. Arrays derived from it
(slices, stacks) use dask's plain optimizer: persist the augmented array first, then derive.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import dask
import dask.array as da
import numpy as np
from dask._task_spec import Alias, Task, TaskRef
from dask.base import tokenize
from dask.array.optimization import optimize as array_optimize
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

import augment as aug
from pipeline.core import keys
from pipeline.core.rng import rng_for
from pipeline.data.readers import Shard


class AugmentTask(Task):
    """A Task that linear fusion leaves alone (like distributed's P2P barrier), so the
    ``augment-`` key and its resources annotation survive ``optimize``."""

    __slots__ = ()

    @property
    def block_fusion(self) -> bool:
        return True


def augment_rng(seed: int, epoch: int) -> Callable[[int], np.random.Generator]:
    """``j -> rng_for(seed, "augment", epoch, j)``: the generator of chunk j (picklable).

    >>> g = augment_rng(0, 1)
    >>> bool(g(2).integers(1 << 30) == rng_for(0, "augment", 1, 2).integers(1 << 30))
    True
    """
    return functools.partial(rng_for, seed, "augment", epoch)


def augment_positions(images: np.ndarray, positions: np.ndarray, policy: aug.Compose,
                      seed: int, epoch: int, chunk: int) -> np.ndarray:
    """The kernel of both paths: ``images[i]`` sits at ``positions[i]`` of the epoch's order.

    The parameters of position p come from ``rng_for(seed, "augment", epoch, p // chunk)``, so a
    sample's augmentation does not depend on how positions are split among tasks.
    (n, C, H, W) uint8 -> same.
    """
    params = aug.sample_for_positions(policy, augment_rng(seed, epoch), positions, chunk)
    return policy.apply(images, params)


def augment_chunk(images: np.ndarray, policy: aug.Compose, seed: int, epoch: int,
                  chunk_index: int, chunk: int) -> np.ndarray:
    """Task body: augment chunk ``chunk_index`` (global positions ``chunk_index*chunk ...``).

    images: (n, C, H, W) uint8 with n <= chunk (the last chunk may be short) -> same.
    """
    start = chunk_index * chunk
    return augment_positions(images, np.arange(start, start + len(images)), policy, seed, epoch,
                             chunk)


def augment(image_blocks: list, label_blocks: list, starts: tuple, indices: np.ndarray,
            positions: np.ndarray, policy: str, seed: int, epoch: int, chunk: int) -> Shard:
    """Task body of training: gather one replica's shard from the raw blocks and augment it.

    ``indices`` are dataset rows, ``positions`` their places in the epoch's order (see
    ``augment_positions``). Returns uint8 (n, 3, H, W) images and int32 labels.
    """
    first = image_blocks[0]
    images = np.empty((len(indices),) + first.shape[1:], dtype=first.dtype)
    labels = np.empty(len(indices), dtype=np.int32)
    ends = tuple(starts[1:]) + (starts[-1] + len(image_blocks[-1]),)
    for block_images, block_labels, lo, hi in zip(image_blocks, label_blocks, starts, ends):
        mask = (indices >= lo) & (indices < hi)
        if mask.any():
            images[mask] = block_images[indices[mask] - lo]
            labels[mask] = block_labels[indices[mask] - lo]
    return Shard(augment_positions(images, positions, aug.get_policy(policy), seed, epoch,
                                   chunk), labels)


class KeyAnnotation:
    """A per-key layer annotation: ``values[key]``, or None (no annotation) for other keys."""

    def __init__(self, values: dict):
        self.values = values

    def __call__(self, key):
        return self.values.get(key)


def _optimize_keeping_annotations(dsk, keys, **kwargs):
    """dask.array's optimizer, then the input layers' annotations put back on the keys that survive.

    Fusion renames or merges most keys, but augment- tasks are never fused, so their annotations
    come back intact; the result is one layer whose annotations are `KeyAnnotation` lookups.
    """
    marks: dict = {}
    for layer in dsk.layers.values() if isinstance(dsk, HighLevelGraph) else ():
        for name, value in (layer.annotations or {}).items():
            marks.setdefault(name, {}).update(
                {k: value(k) if callable(value) else value for k in layer})
    out = array_optimize(dsk, keys, **kwargs)
    if isinstance(out, HighLevelGraph) or not marks:
        return out
    annotations = {name: KeyAnnotation(values) for name, values in marks.items()}
    return HighLevelGraph({"optimized": MaterializedLayer(out, annotations=annotations)},
                          {"optimized": set()})


def _check_args(images, seed: int, epoch: int, chunk: int) -> None:
    if not isinstance(images, da.Array) or images.ndim != 4 or images.dtype != np.uint8:
        raise ValueError("images must be a dask array of uint8 (N, C, H, W) images, got "
                         f"{type(images).__name__} {getattr(images, 'dtype', '')} "
                         f"{getattr(images, 'shape', '')}")
    if chunk < 1:
        raise ValueError(f"augment.chunk must be >= 1, got {chunk}")
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")


def augment_array(images: da.Array, policy: aug.Compose, seed: int, epoch: int, chunk: int,
                  resources: dict | None = None) -> da.Array:
    """The epoch's augmented images: (N, C, H, W) uint8 dask array -> same shape, chunks of ``chunk``.

    ``images`` is rechunked to the fixed plan [0, chunk), [chunk, 2*chunk), ... (no-op when it
    already has it, e.g. the raw data persisted once with that plan); one ``augment-`` task per
    chunk, annotated with ``resources`` (e.g. ``{"CPU": 1}``, see `cpu_resources`) when given.
    """
    _check_args(images, seed, epoch, chunk)
    images = images.rechunk({0: chunk, 1: -1, 2: -1, 3: -1})
    token = tokenize(images.name, policy, seed, epoch, chunk)[:8]
    name, out = keys.prefix("augment", token), keys.prefix("augmented", token)
    tasks, aliases = {}, {}
    for j in range(images.numblocks[0]):
        key = (name, epoch, j)
        tasks[key] = AugmentTask(key, augment_chunk, TaskRef((images.name, j, 0, 0, 0)), policy,
                                 seed, epoch, j, chunk)
        aliases[(out, j, 0, 0, 0)] = Alias((out, j, 0, 0, 0), key)
    with dask.annotate(**({"resources": dict(resources)} if resources else {})):
        layer = HighLevelGraph.from_collections(name, tasks, dependencies=[images])
    graph = HighLevelGraph({**layer.layers, out: aliases},
                           {**layer.dependencies, out: {name}})
    array = da.Array(graph, out, images.chunks, dtype=np.uint8)
    if resources:
        array.__dask_optimize__ = _optimize_keeping_annotations  # see the module docstring
    return array


def cpu_resources(client, name: str = "CPU") -> dict | None:
    """``{name: 1}`` when some worker of ``client``'s cluster advertises resource ``name``, else None.

    Annotating with a resource no worker has would leave the tasks waiting forever, so a plain
    LocalCluster gets no annotation and runs augment- tasks anywhere.
    """
    from pipeline.cluster.connection import has_resource  # the one resource probe
    return {name: 1} if has_resource(client, name) else None
